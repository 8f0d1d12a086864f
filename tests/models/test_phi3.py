"""Phi-3 and Phi-4-mini on the native engine: q, k and v in one stored matrix, gate and up in
another, longrope's per-dimension factors and attention factor, a partial rotary factor
(Phi-4-mini's 0.75), and the positions the engine runs such a model to (a sliding window, the
original context of longrope's short factors). Logits against transformers' Phi3 on the same
random weights, from a safetensors folder and from a GGUF file in llama.cpp's phi3 layout.
Failed on: longrope's attention factor dropped (in the folder's RoPE table, or read as 1 from
the GGUF), its short factors dropped, the unrotated quarter of each head rotated, the window not
read (the limit test)."""

import math

import pytest
import torch

from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import reference, write_gguf
from tests.models.test_qwen3 import FEEDS, STEPS, assert_close_in_kl, in_pieces, logits, saved_tiny

VOCAB = 64
ORIGINAL = 32  # longrope's original context: the test's sequences stay inside it
SHORT = [1.0, 1.3, 2.1]  # head_dim 8, rotary 6: three pairs turned
LONG = [2.0, 3.5, 5.0]


def _phi3(folder, **rope):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **rope,
    )  # fmt: skip
    return saved_tiny(Phi3ForCausalLM, config, folder, seed=5)


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    """Phi-4-mini's switches: longrope, a partial rotary factor of 0.75."""
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": SHORT, "long_factor": LONG,
    }  # fmt: skip
    return _phi3(tmp_path_factory.mktemp("tiny-phi4-mini"), rope_parameters=rope)


@pytest.fixture(scope="module")
def phi3_mini(tmp_path_factory):
    """Phi-3-mini-4k's: plain RoPE over whole heads, a sliding window."""
    folder = tmp_path_factory.mktemp("tiny-phi3-mini")
    return _phi3(folder, sliding_window=48, rope_parameters={"rope_theta": 10000.0})


def test_the_config_reads_phi3s_switches(phi4_mini, phi3_mini):
    config = LlamaConfig.read(phi4_mini[1])
    assert (config.rope.scaling, config.rope.dim, config.head_dim) == ("longrope", 6, 8)
    assert config.rope.freq_factors == tuple(SHORT) and config.rope.attention_factor > 1
    assert config.context_length() == ORIGINAL
    mini = LlamaConfig.read(phi3_mini[1])
    assert (mini.rope.scaling, mini.rope.dim, mini.window, mini.context_length()) == (
        "default", 8, 48, 128,  # every attention masks the window: max_position_embeddings
    )  # fmt: skip


@pytest.mark.parametrize("which", ["phi4_mini", "phi3_mini"])
def test_logits_match_transformers_on_a_ragged_batch(which, request):
    hf, folder = request.getfixturevalue(which)
    model = LlamaModel.from_folder(folder)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def test_the_unrotated_dimensions_and_the_factors_matter(phi4_mini, monkeypatch):
    """Turning every dimension, or dropping longrope's factors, misses transformers by far: the
    ragged-batch test would see either mistake."""
    import dataclasses

    hf, folder = phi4_mini
    want = reference(hf, FEEDS[0] + STEPS[0])
    config = LlamaConfig.read(folder)
    for wrong in (
        dataclasses.replace(config.rope, freq_factors=None),
        dataclasses.replace(config.rope, attention_factor=1.0),
    ):
        monkeypatch.setattr(LlamaConfig, "read", lambda path, r=wrong: dataclasses.replace(
            config, rope=r))  # fmt: skip
        out = logits(LlamaModel.from_folder(folder), FEEDS, STEPS)[0]
        assert (out - want).abs().max() > 0.05
    whole = dataclasses.replace(config.rope, dim=8, freq_factors=(*SHORT, 1.0))
    monkeypatch.setattr(LlamaConfig, "read", lambda path: dataclasses.replace(config, rope=whole))
    out = logits(LlamaModel.from_folder(folder), FEEDS, STEPS)[0]
    assert (out - want).abs().max() > 0.05


def test_a_position_past_the_limit_is_refused_naming_why(phi4_mini):
    """Up to the limit the model runs; one position more is a ValueError that says why
    (longrope's short factors), before anything is written."""
    _, folder = phi4_mini
    model = LlamaModel.from_folder(folder)
    kv = model.new_kv(32, 4)
    seq = kv.new_sequence()
    model.forward_ragged(kv, [seq], [torch.arange(ORIGINAL) % VOCAB], [1])  # the last fits
    with pytest.raises(ValueError, match="original context"):
        model.forward_ragged(kv, [seq], [torch.tensor([3])], [1])


@pytest.mark.parametrize("attention", ["gather", "reference", "triton"])
def test_past_its_window_phi3_matches_transformers(phi3_mini, attention):
    """60 positions over a window of 48: a 50-token prefill, then steps past the window, on
    each attention (the paged ones through the page tables, Triton's in its interpreter)."""
    hf, folder = phi3_mini
    model = LlamaModel.from_folder(folder, attention=attention)
    assert model.context_length == 128  # max_position_embeddings: the window is no bound
    ids = [(5 * i + 1) % VOCAB for i in range(60)]
    out = in_pieces(model, ids, cuts=(50,))
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_int8_on_the_kernel_is_close_to_float32(phi4_mini):
    hf, folder = phi4_mini
    assert_close_in_kl(LlamaModel.from_folder(folder, dtype="int8"), hf)


def test_an_odd_rotary_width_and_a_factor_list_of_the_wrong_size_are_refused():
    cfg = {
        "model_type": "phi3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
        "original_max_position_embeddings": ORIGINAL,
    }  # fmt: skip
    odd = {"rope_type": "longrope", "partial_rotary_factor": 0.625, "short_factor": SHORT}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.625 turns 5 of 8"):
        LlamaConfig.from_hf(cfg | {"rope_scaling": odd})
    short = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "short_factor": [1.0]}
    with pytest.raises(ValueError, match="short_factor with 3 values"):
        LlamaConfig.from_hf(cfg | {"rope_scaling": short})


def write_phi3_gguf(path, hf, sliding_window=0):
    """The tiny model as a phi3 GGUF file, as llama.cpp's converter lays one out (names written
    here, not taken from the loader): q, k and v in attn_qkv, gate and up in ffn_up, the
    longrope factors as tensors and its attention factor, original context and rotary width as
    metadata (a window of 0: none)."""
    import numpy as np

    c = hf.config
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }  # fmt: skip
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    }  # fmt: skip
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in layer.items()})
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads

    def phi3(w):
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_sliding_window(sliding_window)
        if rope.get("short_factor"):
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings))
            )
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], "f4")
                w.add_tensor(f"rope_factors_{kind}.weight", factors)

    assert rope["rope_theta"] == 10000.0  # the base write_gguf writes
    write_gguf(path, hf, arch="phi3", extra=phi3, names=names)


@pytest.mark.parametrize("which", ["phi4_mini", "phi3_mini"])
def test_a_gguf_file_loads_the_same_model(which, request, tmp_path):
    """The folder's model from llama.cpp's phi3 layout: the same config (window, partial
    rotary, longrope) and logits."""
    hf, folder = request.getfixturevalue(which)
    window = 48 if which == "phi3_mini" else 0
    write_phi3_gguf(tmp_path / "phi3.gguf", hf, sliding_window=window)
    model = LlamaModel.from_gguf(tmp_path / "phi3.gguf")
    want = LlamaConfig.read(folder)
    got = model.config
    assert (got.rope.dim, got.rope.scaling, got.window, got.context_length()) == (
        want.rope.dim, want.rope.scaling, want.window, want.context_length(),
    )  # fmt: skip
    assert got.rope.attention_factor == pytest.approx(want.rope.attention_factor)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)
