"""Gemma 3's text model on the native engine: embeddings scaled by sqrt(hidden), norms stored
as w for a scale of 1 + w, a norm on the attention's and the MLP's outputs as well as before
each, GeLU (tanh), scores scaled by query_pre_attn_scalar, per-head q/k norms, and its sliding
layers on a RoPE base of their own, over their window's last keys. Logits against transformers'
Gemma3ForCausalLM on the same random weights, past the sliding window, on both CPU attention
paths (PyTorch's over gathered keys in float32, the kernel's in int8) and on the paged ones
(the torch reference and the Triton kernel)."""

import pytest
import torch

from smcspec.models import loader
from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import reference, write_gguf
from tests.models.test_qwen3 import FEEDS, STEPS, assert_close_in_kl, in_pieces, logits

VOCAB = 64  # a multiple of 16: the output layer on the kernel too
WINDOW = 4  # FEEDS then STEPS reach 7 positions: past it


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma3")
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(5)
    hf = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():  # norms' w around 0: scales around 1, none equal
            p.copy_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder)
    return hf, folder


def test_the_config_reads_gemmas_switches(gemma3):
    _, folder = gemma3
    c = LlamaConfig.read(folder)
    assert c.sandwich_norms and c.qk_norm and c.tie_embeddings and c.activation == "gelu_tanh"
    assert (c.norm_offset, c.embed_scale) == (1.0, 32**0.5)
    assert c.query_scale == pytest.approx((16 / 24) ** 0.5)
    assert c.sliding == (True, True, False) and c.window == WINDOW
    assert (c.rope.theta, c.local_rope.theta) == (1_000_000.0, 10_000.0)
    assert c.context_length() == 256  # every attention masks the window: no bound
    assert [c.window_of(i) for i in range(3)] == [WINDOW, WINDOW, 0]
    assert loader.native_refusal(str(folder)) is None


def test_logits_match_transformers_on_a_ragged_batch(gemma3):
    hf, folder = gemma3
    model = LlamaModel.from_folder(folder)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "drop", ["output norms", "query scale", "local rope", "embedding scale", "norm offset"]
)
def test_each_switch_matters_on_these_weights(gemma3, drop):
    """The same model with one of Gemma's switches undone misses transformers by far: the
    match above is no accident of weights that hide them."""
    hf, folder = gemma3
    model = LlamaModel.from_folder(folder)
    for layer in model.layers:
        if drop == "output norms":
            layer.attn_out_norm = layer.mlp_out_norm = None
        elif drop == "query scale":
            layer.q_norm = layer.q_norm / model.config.query_scale
        elif drop == "norm offset":
            layer.input_norm = layer.input_norm - 1.0
    if drop == "local rope":
        model.local_rope = None
    elif drop == "embedding scale":
        model.embed_scale = torch.tensor(1.0)
    out = logits(model, FEEDS, STEPS)[0]
    assert (out - reference(hf, FEEDS[0] + STEPS[0])).abs().max() > 1e-2


def test_a_long_sequence_in_pieces_matches_transformers(gemma3):
    """30 positions (7 windows): a 13-token prefill, a 9-token chunk over it, then steps."""
    hf, folder = gemma3
    ids = [(7 * i + 3) % VOCAB for i in range(30)]
    for model in (LlamaModel.from_folder(folder), LlamaModel.from_folder(folder, dtype="int8")):
        out = in_pieces(model, ids)
        want = reference(hf, ids)
        if model.dtype == "float32":
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        else:  # int8: near, position by position
            kl = torch.nn.functional.kl_div(
                out.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none"
            ).sum(-1)
            assert kl.max() < 0.02, kl


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_on_the_paged_attention_past_the_window_matches_transformers(gemma3, attention):
    """The paged attentions mask each sliding layer's window too (Triton's in its interpreter):
    a 13-token prefill, a 9-token chunk over it (Triton's packed tiles), then steps, 30
    positions over a window of 4."""
    hf, folder = gemma3
    model = LlamaModel.from_folder(folder, attention=attention)
    assert model.context_length == 256
    ids = [(7 * i + 3) % VOCAB for i in range(30)]
    out = in_pieces(model, ids)
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_int8_on_the_kernel_is_close_to_float32(gemma3):
    """int8 (position 0 computed apart, through Gemma's layer too) against the float model."""
    hf, folder = gemma3
    assert_close_in_kl(LlamaModel.from_folder(folder, dtype="int8"), hf)


def test_a_capped_or_bidirectional_gemma_is_refused_before_loading():
    base = {
        "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "head_dim": 16,
    }  # fmt: skip
    for extra, named in (
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "both ways"),
        ({"hidden_activation": "relu"}, "relu"),
    ):
        with pytest.raises(ValueError, match=named):
            LlamaConfig.from_hf({**base, **extra})


def write_gemma3_gguf(path, hf):
    """The tiny model as a gemma3 GGUF file, as llama.cpp's converter lays one out (names written
    here, not taken from the loader): four norms a layer, each stored as its scale 1 + w, the
    output layer tied to the embeddings, the global RoPE base and the window as metadata; the
    rest (the layers' pattern, the local base, the query scale) llama.cpp fixes in code."""
    c = hf.config
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(c.num_hidden_layers):
        names.update(
            {f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for k, v in layer.items()}
        )

    def gemma3(w):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)

    theta = c.rope_parameters["full_attention"]["rope_theta"]
    shift = lambda name: 1.0 if name.endswith("norm.weight") else 0.0  # noqa: E731
    write_gguf(path, hf, arch="gemma3", extra=gemma3, names=names, rope_base=theta, shift=shift)


@pytest.fixture(scope="module")
def gemma3_as_llama_cpp_has_it():
    """A tiny Gemma 3 of the shape llama.cpp assumes: six layers, the sixth global, scores scaled
    by 1/sqrt(head_dim), the sliding layers' RoPE base 10k."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=16,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    torch.manual_seed(6)
    hf = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return hf


def test_a_gguf_file_loads_the_same_model(gemma3_as_llama_cpp_has_it, tmp_path):
    """llama.cpp's gemma3 layout: the same switches, and transformers' logits past the window
    (the norms' added 1 taken back off, the RoPE bases and the window read or fixed as llama.cpp
    does)."""
    hf = gemma3_as_llama_cpp_has_it
    write_gemma3_gguf(tmp_path / "gemma3.gguf", hf)
    model = LlamaModel.from_gguf(tmp_path / "gemma3.gguf")
    c = model.config
    assert c.sliding == (True,) * 5 + (False,) and c.window == WINDOW and c.tie_embeddings
    assert (c.rope.theta, c.local_rope.theta, c.query_scale) == (1_000_000.0, 10_000.0, 1.0)
    ids = [(5 * i + 2) % VOCAB for i in range(12)]  # three windows
    kv = model.new_kv(32, 4)
    out = model.forward(kv, [kv.new_sequence()], [torch.tensor(ids)], len(ids))[0]
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)
