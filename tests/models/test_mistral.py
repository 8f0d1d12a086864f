"""Mistral on the native engine: Llama's layer, with v0.1's sliding window over every layer
(`sliding_window` in its config; later versions set none). Logits against transformers'
MistralForCausalLM on the same random weights past the window, fed in pieces and on a ragged
batch; a window the engine ignored fails the first test."""

import pytest
import torch

from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import reference
from tests.models.test_qwen3 import FEEDS, STEPS, in_pieces, logits

VOCAB = 64
WINDOW = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mistral")
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(13)
    hf = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("attention", ["gather", "reference"])
def test_logits_match_transformers_past_the_window(mistral, attention):
    hf, folder = mistral
    model = LlamaModel.from_folder(folder, attention=attention)
    assert [model.config.window_of(i) for i in range(2)] == [WINDOW, WINDOW]
    ids = [(5 * i + 3) % VOCAB for i in range(4 * WINDOW)]
    torch.testing.assert_close(in_pieces(model, ids), reference(hf, ids), rtol=1e-4, atol=1e-4)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def test_a_later_mistral_without_a_window_attends_to_everything():
    cfg = {
        "model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    }  # fmt: skip
    assert LlamaConfig.from_hf({**cfg, "sliding_window": None}).window == 0


def test_a_qwen2_config_that_slides_is_refused_naming_it():
    cfg = {
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    }  # fmt: skip
    assert LlamaConfig.from_hf({**cfg, "use_sliding_window": False, "sliding_window": 8})
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaConfig.from_hf({**cfg, "use_sliding_window": True, "sliding_window": 8})
