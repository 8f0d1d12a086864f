"""Mistral on the native engine: Llama's layer, with v0.1's sliding window over every layer
(`sliding_window` in its config; later versions set none). Logits against transformers'
MistralForCausalLM on the same random weights past the window, fed in pieces and on a ragged
batch; a window the engine ignored fails the first test."""

import pytest
import torch

from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import reference
from tests.models.test_qwen3 import FEEDS, STEPS, in_pieces, logits, saved_tiny

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
    return saved_tiny(MistralForCausalLM, config, folder, seed=13)


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


def test_keys_below_every_window_are_freed_and_the_logits_stay(mistral, monkeypatch):
    """Every layer slides, so pages wholly below the window of the queries to come go back to
    the pool (here with one page kept behind the window): the pool holds a few pages, not the
    whole sequence's, and the logits are still transformers'. A rollback within what is kept
    runs; one that would need a freed key is refused."""
    from smcspec.models import llama

    monkeypatch.setattr(llama, "KEPT_BEHIND_WINDOW", 4)
    hf, folder = mistral
    model = LlamaModel.from_folder(folder)
    ids = [(7 * i + 2) % VOCAB for i in range(12 * WINDOW)]
    kv = model.new_kv(64, 4)
    seq = kv.new_sequence()
    out = [model.forward_ragged(kv, [seq], [torch.tensor(ids[:13])], [13])[0]]
    out += [model.forward_ragged(kv, [seq], [torch.tensor([t])], [1])[0] for t in ids[13:]]
    torch.testing.assert_close(torch.cat(out), reference(hf, ids), rtol=1e-4, atol=1e-4)
    assert kv.allocator.used_pages <= (WINDOW + 4) // 4 + 2  # 24 pages without freeing
    # the last step (at 95) freed the keys below 95 - 8 + 1 - 4 = 84: a query at 91 needs keys
    # from 84 on, the limit, and runs; one at 90 needs key 83 and is refused
    assert kv.forgotten[seq] == 84
    kv.truncate(seq, 91)
    model.forward_ragged(kv, [seq], [torch.tensor([1])], [1])
    kv.truncate(seq, 90)
    with pytest.raises(ValueError, match="fell out of the sliding window"):
        model.forward_ragged(kv, [seq], [torch.tensor([1])], [1])
    kv.release(seq)
    assert kv.allocator.used_pages == 0


def test_a_model_with_global_layers_frees_nothing(mistral):
    """Gemma 3's global layers read every key: no page falls out of every window."""
    import dataclasses

    _, folder = mistral
    config = LlamaConfig.read(folder)
    config = dataclasses.replace(config, sliding=(True, False), local_rope=config.rope)
    model = LlamaModel.random(config, seed=0)
    kv = model.new_kv(64, 4)
    seq = kv.new_sequence()
    model.forward_ragged(kv, [seq], [torch.arange(40) % VOCAB], [1])
    model.forward_ragged(kv, [seq], [torch.tensor([3])], [1])
    assert kv.forgotten[seq] == 0 and kv.allocator.used_pages == 11
