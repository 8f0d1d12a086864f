"""GatherAttention's SDPA call: a prefill from an empty cache goes without a mask and with
is_causal (the only form SDPA's flash kernel takes), every other feed keeps its mask, and
both give the paged reference's attention. PagedAttention hands the kernel query_starts."""

import pytest
import torch
import torch.nn.functional as F

from smcspec.kv.cache import PagedKVCache
from smcspec.models import attention, paged_attention
from smcspec.models.attention import ForwardBatch, GatherAttention, PagedAttention

NH, NKV, D, PAGE = 4, 2, 16, 4


def feed(
    starts: list[int], counts: list[int], seed: int = 0
) -> tuple[PagedKVCache, ForwardBatch, torch.Tensor]:
    """Sequences already holding starts[b] random keys, then appending counts[b] more (their
    keys written too), with random queries [total, NH, D] for the new tokens."""
    g = torch.Generator().manual_seed(seed)
    kv = PagedKVCache(1, NKV, D, PAGE, num_pages=32)
    seqs = [kv.new_sequence() for _ in starts]
    for seq, n in zip(seqs, starts, strict=True):
        kv.reserve(seq, n)
    slots = torch.cat([kv.reserve(s, n) for s, n in zip(seqs, counts, strict=True)])
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    width = max(len(kv.tables[s]) for s in seqs)
    batch = ForwardBatch(
        slots=slots,
        positions=positions,
        seq_index=torch.arange(len(seqs)).repeat_interleave(torch.tensor(counts)),
        block_tables=kv.block_tables(seqs, width),
        gather=GatherAttention.plan(kv, seqs, starts, counts),
    )
    return kv, batch, torch.randn(len(positions), NH, D, generator=g)


def sdpa_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return calls


def paged_reference(q: torch.Tensor, kv: PagedKVCache, batch: ForwardBatch) -> torch.Tensor:
    return paged_attention.reference(
        q, kv.k[0], kv.v[0], batch.block_tables, batch.seq_index, batch.positions, D**-0.5
    )


def test_a_prefill_from_an_empty_cache_is_causal_sdpa_without_a_mask(monkeypatch):
    calls = sdpa_calls(monkeypatch)
    kv, batch, q = feed([0, 0, 0], [6, 6, 6])
    assert batch.gather.mask is None and batch.gather.tmax == 6
    out = GatherAttention()(q, kv, 0, batch)
    assert len(calls) == 1 and calls[0]["attn_mask"] is None and calls[0]["is_causal"]
    torch.testing.assert_close(out, paged_reference(q, kv, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("starts", "counts"),
    [
        ([5, 5], [6, 6]),  # a chunk over a prefix: is_causal would align it top-left
        ([0, 0], [6, 3]),  # ragged counts from empty
        ([0, 3], [6, 6]),  # one sequence from empty, one over a prefix
    ],
)
def test_other_feeds_keep_their_mask(monkeypatch, starts, counts):
    calls = sdpa_calls(monkeypatch)
    kv, batch, q = feed(starts, counts, seed=1)
    out = GatherAttention()(q, kv, 0, batch)
    assert calls[0]["attn_mask"] is not None and not calls[0]["is_causal"]
    torch.testing.assert_close(out, paged_reference(q, kv, batch), rtol=1e-5, atol=1e-5)


def test_a_decode_step_needs_neither_mask_nor_causal(monkeypatch):
    calls = sdpa_calls(monkeypatch)
    kv, batch, q = feed([7, 7], [1, 1], seed=2)
    GatherAttention()(q, kv, 0, batch)
    assert calls[0]["attn_mask"] is None and not calls[0]["is_causal"]


def test_paged_attention_hands_the_kernel_query_starts(monkeypatch):
    seen: list[dict] = []

    def kernel(*args, **kwargs):
        seen.append(kwargs)
        return paged_attention.reference(*args)

    monkeypatch.setattr(paged_attention, "triton_attention", kernel)
    kv, batch, q = feed([3, 0], [2, 2], seed=3)
    batch.query_starts = torch.tensor([0, 2, 4], dtype=torch.int32)
    batch.max_query_len = 2  # the tile's hint (paged_attention.plan)
    PagedAttention("triton")(q, kv, 0, batch)
    assert seen == [{"query_starts": batch.query_starts, "max_query_len": 2, "window": 0}]


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_prefills_are_routed_by_where_they_start(kernel):
    """A step stays on the model's paged path; a prefill from an empty cache takes SDPA's
    causal path; a long chunk over a prefix takes the Triton kernel (it packs query tokens)
    but never the paged reference, whose gather is [tokens, keys, heads, d]."""
    paged, gather = PagedAttention(kernel), GatherAttention()
    assert attention.for_feed(paged, gather, [5, 0], [16, 1]) is paged
    assert attention.for_feed(paged, gather, [0, 0], [17, 17]) is gather
    assert attention.for_feed(paged, gather, [0, 0], [40, 3]) is gather
    over_prefix = attention.for_feed(paged, gather, [20, 0], [17, 1])
    assert over_prefix is (paged if kernel == "triton" else gather)
    assert attention.for_feed(gather, gather, [20], [17]) is gather
