"""SmolLM3 on the native engine: Llama's layer, but every 4th layer without RoPE (its
`no_rope_layers`: such a layer's q and k carry no positions). Logits against transformers'
SmolLM3ForCausalLM on the same random weights, on a ragged batch and a long sequence in pieces
(the CPU's attention paths and the paged reference); int8 on the kernel close to float32."""

import pytest
import torch

from smcspec.models import loader
from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import gguf_names, reference, write_gguf
from tests.models.test_qwen3 import FEEDS, STEPS, assert_close_in_kl, in_pieces, logits, saved_tiny

VOCAB = 64


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-smollm3")
    config = SmolLM3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert config.no_rope_layers == [1, 1, 1, 0]
    return saved_tiny(SmolLM3ForCausalLM, config, folder, seed=9)


def test_the_config_reads_which_layers_rotate(smollm3):
    _, folder = smollm3
    c = LlamaConfig.read(folder)
    assert c.rotary == (True, True, True, False) and c.tie_embeddings
    assert [c.rotates(i) for i in range(4)] == [True, True, True, False]
    assert loader.native_refusal(str(folder)) is None


@pytest.mark.parametrize("attention", ["gather", "reference"])
def test_logits_match_transformers(smollm3, attention):
    hf, folder = smollm3
    model = LlamaModel.from_folder(folder, attention=attention)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)
    ids = [(3 * i + 5) % VOCAB for i in range(30)]
    out = in_pieces(model, ids)
    torch.testing.assert_close(out, reference(hf, ids), rtol=1e-4, atol=1e-4)


def test_rotating_the_fourth_layer_misses_by_far(smollm3):
    """The same model with its NoPE layer rotated: these weights show the switch."""
    import dataclasses

    hf, folder = smollm3
    model = LlamaModel.from_folder(folder)
    model.config = dataclasses.replace(model.config, rotary=())
    out = logits(model, FEEDS, STEPS)[0]
    assert (out - reference(hf, FEEDS[0] + STEPS[0])).abs().max() > 1e-2


def test_a_gguf_file_loads_the_same_model(smollm3, tmp_path):
    """llama.cpp's smollm3 layout: Llama's names, q/k rows permuted, the embeddings tied, and
    no key for the NoPE layers (llama.cpp fixes every 4th, as transformers' default does)."""
    hf, _ = smollm3
    base = hf.config.rope_parameters["rope_theta"]  # SmolLM3's 2e6, not write_gguf's 1e4
    write_gguf(tmp_path / "smollm3.gguf", hf, arch="smollm3", names=gguf_names(hf, "smollm3"),
               rope_base=base)  # fmt: skip
    model = LlamaModel.from_gguf(tmp_path / "smollm3.gguf")
    assert model.config.rotary == (True, True, True, False) and model.config.tie_embeddings
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def test_int8_on_the_kernel_is_close_to_float32(smollm3):
    """int8 on the kernel (position 0 computed apart) against the float model."""
    hf, folder = smollm3
    assert_close_in_kl(LlamaModel.from_folder(folder, dtype="int8"), hf)


def test_a_sliding_window_smollm3_is_refused_before_loading():
    cfg = {
        "model_type": "smollm3", "vocab_size": VOCAB, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    }  # fmt: skip
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaConfig.from_hf({**cfg, "use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries for 4 layers"):
        LlamaConfig.from_hf({**cfg, "no_rope_layers": [1, 1, 0]})
    assert LlamaConfig.from_hf(cfg).rotary == (True, True, True, False)  # the interval's
