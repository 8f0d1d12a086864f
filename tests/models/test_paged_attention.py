"""Paged attention: the torch reference against the obvious per-token loop in float64, and the
Triton kernel against the reference, on ragged batches whose unused pages are poisoned.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors. triton.jit picks the
interpreter when it decorates a kernel, and `paged_attention` decorates its kernel once, on the
first call, for the whole process; so TRITON_INTERPRET is set here, at collection time, before
any test can build it (and before triton itself is imported). On a CUDA machine the variable is
left alone and the kernel is compiled for the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from smcspec.models import paged_attention
from smcspec.models.paged_attention import (
    plan,
    reference,
    triton_attention,
    triton_available,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if not triton_available(DEVICE):
    pytest.skip("Triton can run neither on a GPU nor in its interpreter", allow_module_level=True)

# A key this large dominates any softmax it enters (exp overflows), so a kernel that read an
# unused page or slot would be far off. NaN would prove nothing: a masked load replaces it.
POISON = 1e4
# A ragged batch, one (length, new tokens) per sequence: a first token, a zero-length sequence
# (a graph's padding row) at the front and in the middle, a whole prefill, a verify of K+1 = 5,
# a decode, and an 18-token prefill chunk over a 22-token prefix.
RAGGED = ((0, 0), (1, 1), (6, 6), (9, 0), (33, 5), (80, 1), (40, 18))
DECODE = ((1, 1), (17, 1), (50, 1), (0, 0))  # one token a sequence: 16-row tiles
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # rtol = atol


def make_batch(
    page_size: int,
    nh: int,
    nkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    seqs: tuple[tuple[int, int], ...] = RAGGED,
) -> dict[str, torch.Tensor | float]:
    """Sequences of seqs' lengths in a pool of shuffled pages; the last n positions of each
    sequence are its query tokens, contiguous flat rows in sequence order (query_starts'
    contract). Unused table entries point at a page full of POISON, and the slots past each
    sequence's end in its last page hold POISON too."""
    lengths, queries = zip(*seqs, strict=True)
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page_size) for n in lengths]
    num_pages = sum(used) + 2  # + the poison page + one page no table names
    order = torch.randperm(num_pages, generator=g).tolist()
    k = torch.randn(num_pages, page_size, nkv, d, generator=g)
    v = torch.randn(num_pages, page_size, nkv, d, generator=g)
    poison_page = order.pop()
    k[poison_page] = v[poison_page] = POISON
    tables = torch.full((len(lengths), max(used) + 1), poison_page, dtype=torch.int32)
    for b, (n_pages, length) in enumerate(zip(used, lengths, strict=True)):
        tables[b, :n_pages] = torch.tensor(order[:n_pages], dtype=torch.int32)
        del order[:n_pages]
        if length:
            last = int(tables[b, n_pages - 1])
            k[last, (length - 1) % page_size + 1 :] = POISON
            v[last, (length - 1) % page_size + 1 :] = POISON
    seq_index = torch.cat([torch.full((n,), b) for b, n in enumerate(queries)])
    positions = torch.cat([torch.arange(m - n, m) for m, n in seqs])
    q = torch.randn(len(positions), nh, d, generator=g)
    return {
        "q": q.to(DEVICE, dtype),
        "k_cache": k.to(DEVICE, dtype),
        "v_cache": v.to(DEVICE, dtype),
        "block_tables": tables.to(DEVICE),
        "seq_index": seq_index.to(DEVICE, torch.int32),
        "positions": positions.to(DEVICE, torch.int32),
        "scale": d**-0.5,
    }


def query_starts(batch: dict) -> torch.Tensor:
    counts = torch.bincount(batch["seq_index"].long(), minlength=batch["block_tables"].shape[0])
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def brute_force(
    q, k_cache, v_cache, block_tables, seq_index, positions, scale, window=0
) -> torch.Tensor:
    """The definition, one token and one head at a time, in float64: each token over the keys
    at and before its position, the last `window` of them where window > 0."""
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // nkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        b, pos = int(seq_index[t]), int(positions[t])
        first = max(0, pos - window + 1) if window else 0
        keys = range(first, pos + 1)
        slots = [(int(block_tables[b, j // page_size]), j % page_size) for j in keys]
        k = torch.stack([k_cache[p, o] for p, o in slots]).double()  # [L, nkv, d]
        v = torch.stack([v_cache[p, o] for p, o in slots]).double()
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[t, h].double() * scale  # [L]
            out[t, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("page_size", "nh", "nkv", "d"), [(1, 2, 2, 16), (3, 12, 2, 16), (16, 7, 1, 32)]
)
def test_reference_is_the_per_token_definition(page_size, nh, nkv, d):
    batch = make_batch(page_size, nh, nkv, d, torch.float32, seed=page_size)
    expected = brute_force(**{n: x.cpu() if torch.is_tensor(x) else x for n, x in batch.items()})
    assert_matches(reference(**batch), expected, torch.float32)


@pytest.mark.parametrize(
    ("page_size", "nh", "nkv", "d", "dtype", "splits", "seqs"),
    [
        (1, 2, 2, 64, torch.float32, None, RAGGED),  # group 1, one key a page
        (3, 4, 2, 64, torch.float32, 2, RAGGED),  # group 2
        (4, 14, 2, 64, torch.float32, 1, RAGGED),  # group 7, d 64 (Qwen2.5-0.5B)
        (16, 7, 1, 128, torch.float32, 3, RAGGED),  # group 7, d 128 (7B)
        (16, 12, 2, 128, torch.bfloat16, None, RAGGED),  # group 6, d 128 (Qwen2.5-1.5B)
        (3, 7, 1, 64, torch.bfloat16, 5, RAGGED),  # more splits than the 2 key tiles of 80
        (4, 14, 2, 64, torch.bfloat16, None, DECODE),
        (1, 4, 2, 128, torch.float32, 2, DECODE),
        (3, 4, 2, 24, torch.float32, 2, DECODE),  # a head padded to the 32-wide tile
        (4, 4, 2, 8, torch.bfloat16, None, RAGGED),  # padded to 16 (the test models' heads)
    ],
)
def test_triton_matches_reference(page_size, nh, nkv, d, dtype, splits, seqs):
    """Shown failing on a kernel that maps query head h to kv head h % nkv (not h // GROUP),
    bounds keys by < position, merges splits without the exp(m_s - m) rescaling, lets split
    ranges overlap by a tile, or skips writing an empty split's partials; and on query_starts
    derived one sequence off."""
    batch = make_batch(page_size, nh, nkv, d, dtype, seed=100 + page_size * nh + d, seqs=seqs)
    out = torch.full_like(batch["q"], float("nan"))  # every element must be written
    result = triton_attention(**batch, out=out, splits=splits)
    assert result is out and result.dtype == dtype
    assert_matches(out, reference(**batch), dtype)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_reference_with_a_sliding_window_is_the_per_token_definition(window):
    batch = make_batch(3, 4, 2, 16, torch.float32, seed=window)
    expected = brute_force(
        **{n: x.cpu() if torch.is_tensor(x) else x for n, x in batch.items()}, window=window
    )
    assert_matches(reference(**batch, window=window), expected, torch.float32)
    if window < 40:  # some token's window leaves keys out: the window matters here
        assert not torch.allclose(reference(**batch), reference(**batch, window=window))


@pytest.mark.parametrize(
    ("page_size", "nh", "nkv", "d", "dtype", "splits", "window"),
    [
        (1, 2, 2, 64, torch.float32, None, 1),  # each token its own key only
        (3, 4, 2, 64, torch.float32, 2, 7),  # windows crossing pages and split bounds
        (16, 12, 2, 128, torch.bfloat16, None, 16),
        (4, 14, 2, 64, torch.float32, 3, 33),  # the first tile skipped for some rows only
        (16, 7, 1, 128, torch.float32, 5, 512),  # wider than every sequence: no effect
    ],
)
def test_triton_with_a_sliding_window_matches_reference(
    page_size, nh, nkv, d, dtype, splits, window
):
    """RAGGED and a 40-token chunk over 260 keys, whose rows' windows start at different key
    tiles. Shown failing on a kernel that starts every row's keys at 0 but masks nothing (the
    window ignored), that starts a q-block's keys at its highest row's window (not its
    lowest's), or that lets a row see one key more than its window."""
    seqs = (*RAGGED, (300, 40))
    batch = make_batch(page_size, nh, nkv, d, dtype, seed=7 * window + d, seqs=seqs)
    out = torch.full_like(batch["q"], float("nan"))
    triton_attention(**batch, out=out, splits=splits, window=window)
    assert_matches(out, reference(**batch, window=window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_pages_shared_by_forked_particles(dtype):
    """Particles forked from one prefix share its pages (and SMC resampling copies tables),
    so several sequences' tables name the same pages; each still has its own last page."""
    seqs = ((30, 1), (30, 1), (30, 5), (12, 3))
    batch = make_batch(4, 7, 1, 64, dtype, seed=5, seqs=seqs)
    tables = batch["block_tables"]
    tables[1:3, :7] = tables[0, :7]  # the 28 keys before the last page
    out = triton_attention(**batch, splits=2, query_starts=query_starts(batch))
    assert_matches(out, reference(**batch), dtype)


def test_triton_takes_int64_positions_and_allocates_its_output():
    batch = make_batch(3, 4, 2, 16, torch.float32, seed=7)
    expected = reference(**batch)
    batch["positions"] = batch["positions"].long()
    assert_matches(triton_attention(**batch), expected, torch.float32)


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append((self.kernel.fn.__name__, grid))
        return self.kernel[grid]


def spy_launches(monkeypatch) -> list:
    launches: list = []
    kernels = paged_attention._kernels()
    monkeypatch.setattr(
        paged_attention, "_kernels", lambda: tuple(LaunchSpy(k, launches) for k in kernels)
    )
    return launches


@pytest.mark.parametrize("splits", [1, 3])
def test_launch_is_per_query_block_kv_head_and_split(monkeypatch, splits):
    """A verify of K+1 = 9 tokens with 7 query heads a kv head is ONE 63-row tile a
    (sequence, kv head, split): each key is read once there, not once per token and head. The
    grid has B spare q-block rows (they exit); S = 1 launches no merge. Shown failing on a
    plan with one 16-row tile for all (the verify then takes 5 q-blocks a sequence)."""
    launches = spy_launches(monkeypatch)
    seqs = ((20, 9), (11, 9), (33, 9))
    batch = make_batch(16, 14, 2, 64, torch.bfloat16, seed=3, seqs=seqs)
    out = triton_attention(**batch, splits=splits)
    assert_matches(out, reference(**batch), torch.bfloat16)
    q_blocks = 27 // 9 + 3
    expected = [("paged_attention_kernel", (q_blocks, 2, splits))]
    if splits > 1:
        expected.append(("merge_splits_kernel", (27, 14)))
    assert launches == expected


def test_plan_for_the_engine_shapes():
    """7B (28 query / 4 kv heads, d 128): a batch-1 decode is 1 q-block x 4 kv heads, so it
    splits its keys 16 ways to near 2 x 132 SMs; 64 decoding sequences fill the GPU unsplit;
    an 8 x 9 verify packs each sequence's 63 rows into one 64-row tile."""
    decode = plan(1, 1, 28, 4, 128, max_keys=32768)
    assert (decode.block_q, decode.block_m, decode.block_n) == (2, 16, 32)
    assert decode.grid == (1 // 2 + 1, 4, 16)
    assert plan(64, 64, 28, 4, 128, max_keys=32768).splits == 1
    verify = plan(72, 8, 28, 4, 128, max_keys=32768)
    assert (verify.block_q, verify.block_m) == (9, 64)
    assert verify.grid == (72 // 9 + 8, 4, 5)
    # 16-row tiles pipeline two key tiles deep, 64-row ones three (no spills for sm_90)
    assert (decode.num_warps, decode.num_stages, verify.num_stages) == (4, 2, 3)
    assert plan(72, 8, 28, 4, 128, max_keys=32768, dtype=torch.float32).block_m == 16
    assert plan(1, 1, 28, 4, 128, max_keys=64).splits == 2  # no more splits than key tiles
    assert plan(1, 1, 14, 2, 64, max_keys=32768, splits=3).grid == (1, 2, 3)
    # a CUDA graph's 8 x 9 verify padded to 96 rows: its average row (one token) would plan a
    # decode tile; its longest row, known on the host, plans the verify's
    assert plan(96, 96, 28, 4, 128, max_keys=32768).block_m == 16
    graphed = plan(96, 96, 28, 4, 128, max_keys=32768, max_query_len=16)
    assert (graphed.block_q, graphed.block_m) == (9, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comparison_rejects_wrong_attention(dtype):
    """The tolerance catches one key too many, and the poison is within reach of a kernel that
    ignored the sequence's end."""
    batch = make_batch(3, 4, 2, 16, dtype, seed=11)
    right = reference(**batch)
    lengths = torch.tensor([n for n, _ in RAGGED], device=DEVICE)[batch["seq_index"].long()]
    one_more = torch.minimum(batch["positions"] + 1, lengths - 1)  # the verify's and prefill's
    assert (one_more > batch["positions"]).any()
    with pytest.raises(AssertionError):
        assert_matches(reference(**{**batch, "positions": one_more}), right, dtype)
    table_end = batch["block_tables"].shape[1] * batch["k_cache"].shape[1] - 1
    whole_table = torch.full_like(batch["positions"], table_end)
    with pytest.raises(AssertionError):
        assert_matches(reference(**{**batch, "positions": whole_table}), right, dtype)


def test_a_graphs_padded_verify_runs_the_wide_tile(monkeypatch):
    """A CUDA graph's 2 x 9 verify in its bucket of 32 rows: 14 padding rows of one token, then
    16 rows of none. max_query_len plans 64-row tiles of 9 tokens (the average row, one token,
    would plan 16-row ones of 2), which read the padded layout right."""
    launches = spy_launches(monkeypatch)
    seqs = ((20, 9), (11, 9)) + ((1, 1),) * 14 + ((0, 0),) * 16
    batch = make_batch(16, 14, 2, 64, torch.bfloat16, seed=4, seqs=seqs)
    out = torch.full_like(batch["q"], float("nan"))
    triton_attention(**batch, out=out, query_starts=query_starts(batch), max_query_len=16)
    assert_matches(out, reference(**batch), torch.bfloat16)
    assert launches == [("paged_attention_kernel", (32 // 9 + 32, 2, 1))]


def test_bad_shapes_raise():
    batch = make_batch(3, 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_attention(**{**batch, "q": batch["q"][:, :3]})
    with pytest.raises(ValueError, match="out must be"):
        triton_attention(**batch, out=torch.empty_like(batch["q"][:-1]))
    with pytest.raises(ValueError, match="splits"):
        triton_attention(**batch, splits=0)
    with pytest.raises(ValueError, match="query_starts"):
        triton_attention(**batch, query_starts=query_starts(batch)[:-1])
    with pytest.raises(ValueError, match="max_query_len"):
        triton_attention(**batch, max_query_len=0)
