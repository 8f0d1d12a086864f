"""OLMo 2 on the native engine: Llama's layer with its norms moved after the attention and the
MLP (none before them) and q and k each RMS-normed over all their heads at once, before RoPE.
Logits against transformers' Olmo2ForCausalLM on the same random weights, on a ragged batch and
a long sequence in pieces; int8 on the kernel close to float32; each switch shown to matter."""

import pytest
import torch

from smcspec.models import loader
from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import gguf_names, reference, write_gguf
from tests.models.test_qwen3 import FEEDS, STEPS, assert_close_in_kl, in_pieces, logits, saved_tiny

VOCAB = 64


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-olmo2")
    config = Olmo2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return saved_tiny(Olmo2ForCausalLM, config, folder, seed=11)


def test_the_config_reads_olmo2s_switches(olmo2):
    _, folder = olmo2
    c = LlamaConfig.read(folder)
    assert c.qk_norm and c.qk_norm_whole and c.sandwich_norms and not c.pre_norms
    assert loader.native_refusal(str(folder)) is None


@pytest.mark.parametrize("attention", ["gather", "reference"])
def test_logits_match_transformers(olmo2, attention):
    hf, folder = olmo2
    model = LlamaModel.from_folder(folder, attention=attention)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)
    ids = [(3 * i + 1) % VOCAB for i in range(30)]
    out = in_pieces(model, ids)
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_a_gguf_file_loads_the_same_model(olmo2, tmp_path):
    """llama.cpp's olmo2 layout (its post_attention_norm and post_ffw_norm, q/k not permuted):
    the same logits as transformers."""
    hf, _ = olmo2
    write_gguf(tmp_path / "olmo2.gguf", hf, arch="olmo2", names=gguf_names(hf, "olmo2"))
    model = LlamaModel.from_gguf(tmp_path / "olmo2.gguf")
    assert model.config.qk_norm_whole and not model.config.pre_norms
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def test_an_olmo3_gguf_is_refused_before_loading(olmo2, tmp_path):
    """OLMo 3 files say olmo2 too, with sliding-window layers the engine does not run."""
    hf, _ = olmo2
    path = tmp_path / "olmo3.gguf"
    write_gguf(path, hf, arch="olmo2", names=gguf_names(hf, "olmo2"),
               extra=lambda w: w.add_sliding_window(16))  # fmt: skip
    with pytest.raises(ValueError, match="sliding-window layers"):
        LlamaConfig.read(path)
    assert "sliding-window" in loader.native_refusal(str(path))


@pytest.mark.parametrize("drop", ["output norms", "whole q/k norm"])
def test_each_switch_matters_on_these_weights(olmo2, drop):
    """The model with a switch undone (its output norms dropped; q and k normed per head with
    the first head's share of the weight) misses transformers by far."""
    hf, folder = olmo2
    model = LlamaModel.from_folder(folder)
    d = model.config.head_dim
    for layer in model.layers:
        if drop == "output norms":
            layer.attn_out_norm = layer.mlp_out_norm = None
        else:
            layer.q_norm, layer.k_norm = layer.q_norm[:d], layer.k_norm[:d]
    out = logits(model, FEEDS, STEPS)[0]
    assert (out - reference(hf, FEEDS[0] + STEPS[0])).abs().max() > 1e-2


def test_int8_on_the_kernel_is_close_to_float32(olmo2):
    hf, folder = olmo2
    assert_close_in_kl(LlamaModel.from_folder(folder, dtype="int8"), hf)


def test_random_weights_of_the_config_load(olmo2):
    """`LlamaModel.random` (bench's random models of real configs) makes OLMo 2's shapes: no
    norms before the blocks, q and k norms over their whole projections."""
    _, folder = olmo2
    config = LlamaConfig.read(folder)
    model = LlamaModel.random(config)
    layer = model.layers[0]
    assert layer.input_norm is None and layer.post_norm is None
    assert layer.q_norm.numel() == 4 * config.head_dim
    assert layer.k_norm.numel() == 2 * config.head_dim
