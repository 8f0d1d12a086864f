"""Chunked prefill (`llama.PREFILL_CHUNK`): a feed longer than a chunk runs as successive passes
of at most a chunk per sequence, with the logits and the cache of one pass, and attention never
sees more than a chunk of queries. The chunk is forced to 4 tokens here."""

import pytest
import torch
import torch.nn.functional as F

from smcspec.engine import LLM
from smcspec.models import llama
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights
from smcspec.models.native import NativeCausalLM

CHUNK = 4
CONFIG = LlamaConfig.from_hf(
    {
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
)  # fmt: skip
# Feeds of a batch: a sequence with a 3-token prefix then 11 tokens (chunks 4, 4, 3) wanting its
# last logit only, and a fresh one of 6 (chunks 4, 2) wanting all (prompt scoring: logits
# across a chunk boundary).
PREFIX, FEEDS, WANTS = 3, (11, 6), [1, 6]


def model(attention: str, dtype: str = "float32") -> LlamaModel:
    weights = random_weights(CONFIG, "cpu", seed=3)
    for name, w in weights.items():  # larger than N(0, 0.02): logits that differ visibly
        weights[name] = w * 10 if "norm" not in name else w
    return LlamaModel(CONFIG, weights, dtype, "cpu", attention)


def feed(m: LlamaModel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The batch above: its logits rows, and each sequence's keys and values of every layer."""
    g = torch.Generator().manual_seed(0)
    kv = m.new_kv(32, 4)
    a, b = kv.new_sequence(), kv.new_sequence()
    m.forward_ragged(kv, [a], [torch.randint(64, (PREFIX,), generator=g)], [1])
    tokens = [torch.randint(64, (n,), generator=g) for n in FEEDS]
    rows = m.forward_ragged(kv, [a, b], tokens, WANTS)
    caches = [t for i in range(CONFIG.num_layers) for s in (a, b) for t in kv.gather(i, s)]
    return rows, caches


def spy_sdpa(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of SDPA's queries [B, nh, T, d] and keys [B, nkv, L, d], call by call: the
    scores it builds are [B, nh, T, L]."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((*q.shape[:3], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("attention", ["gather", "reference"])
def test_chunked_logits_and_cache_equal_one_pass(attention, monkeypatch):
    """Same maths in other shapes: equal within float32 rounding (assert_close's float32
    tolerances, 1.3e-6 relative), on the gather path (SDPA) and the paged one (a chunk of 4 is
    a decode-sized feed, which stays paged)."""
    m = model(attention)
    expected_rows, expected_cache = feed(m)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", CHUNK)
    rows, cache = feed(m)
    assert [r.shape[0] for r in rows] == WANTS
    for got, want in zip(rows, expected_rows, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(cache, expected_cache, strict=True):
        torch.testing.assert_close(got, want)


def test_attention_never_sees_more_than_a_chunk_of_queries(monkeypatch):
    """The point of chunking: SDPA's scores [B, nh, T, L] have T <= the chunk, in ceil(11 / 4)
    = 3 passes of 2 layers."""
    m = model("gather")
    calls = spy_sdpa(monkeypatch)
    feed(m)
    assert max(t for _, _, t, _ in calls) == max(FEEDS)  # the spy sees the unchunked feed
    calls.clear()
    monkeypatch.setattr(llama, "PREFILL_CHUNK", CHUNK)
    feed(m)
    assert len(calls) == CONFIG.num_layers * (1 + 3)  # the prefix's pass, then 3
    assert max(t for _, _, t, _ in calls) == CHUNK
    assert max(b * h * t * n for b, h, t, n in calls) <= 2 * 4 * CHUNK * (PREFIX + max(FEEDS))


def test_int8_keeps_its_sink_row_first(monkeypatch):
    """int8 computes position 0 apart (`LlamaModel._sink`): a chunked scoring of a fresh
    sequence still starts with the sink's logits, then one row per later token."""
    m = model("gather", "int8")
    tokens = torch.arange(1, 10)
    kv = m.new_kv(16, 4)
    expected = m.forward_ragged(kv, [kv.new_sequence()], [tokens], [9])[0]
    monkeypatch.setattr(llama, "PREFILL_CHUNK", CHUNK)
    kv = m.new_kv(16, 4)
    got = m.forward_ragged(kv, [kv.new_sequence()], [tokens], [9])[0]
    assert got.shape == expected.shape == (9, CONFIG.vocab_size)
    assert torch.equal(got[0], expected[0])


def test_generate_chunks_a_long_prompt(monkeypatch):
    """LLM.generate's prefill (the decoders' first forward) goes through the chunks: the same
    tokens for a seed, and no SDPA call with more than a chunk of queries."""

    def generate() -> list[int]:
        target = NativeCausalLM(model("gather"), {0}, 64, 4, graphs=False)
        prompt = list(range(1, 12))
        llm = LLM.from_models(target, target)  # ar never calls its draft
        return llm.generate(prompt, "ar", max_new_tokens=4, stop_at_eos=False, seed=5).token_ids

    expected = generate()
    assert len(expected) == 4
    calls = spy_sdpa(monkeypatch)
    monkeypatch.setattr(llama, "PREFILL_CHUNK", CHUNK)
    assert generate() == expected
    assert max(t for _, _, t, _ in calls) == CHUNK
