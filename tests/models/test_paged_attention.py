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

from smcspec.models.paged_attention import (
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
# Ragged batch: a first token (length 1), a whole prefill, a verify of K+1 = 5 tokens, decode.
LENGTHS = (1, 6, 33, 80)
QUERIES = (1, 6, 5, 1)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # rtol = atol


def make_batch(
    page_size: int, nh: int, nkv: int, d: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor | float]:
    """Sequences of LENGTHS in a pool of shuffled pages; the last QUERIES[b] positions of each
    sequence are its query tokens, in shuffled order. Unused table entries point at a page full
    of POISON, and the slots past each sequence's end in its last page hold POISON too."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page_size) for n in LENGTHS]
    num_pages = sum(used) + 2  # + the poison page + one page no table names
    order = torch.randperm(num_pages, generator=g).tolist()
    k = torch.randn(num_pages, page_size, nkv, d, generator=g)
    v = torch.randn(num_pages, page_size, nkv, d, generator=g)
    poison_page = order.pop()
    k[poison_page] = v[poison_page] = POISON
    tables = torch.full((len(LENGTHS), max(used) + 1), poison_page, dtype=torch.int32)
    for b, (n_pages, length) in enumerate(zip(used, LENGTHS, strict=True)):
        tables[b, :n_pages] = torch.tensor(order[:n_pages])
        del order[:n_pages]
        last = int(tables[b, n_pages - 1])
        k[last, (length - 1) % page_size + 1 :] = POISON
        v[last, (length - 1) % page_size + 1 :] = POISON
    seq_index = torch.cat([torch.full((n,), b) for b, n in enumerate(QUERIES)])
    positions = torch.cat([torch.arange(m - n, m) for m, n in zip(LENGTHS, QUERIES, strict=True)])
    shuffle = torch.randperm(len(positions), generator=g)
    q = torch.randn(len(positions), nh, d, generator=g)
    return {
        "q": q.to(DEVICE, dtype),
        "k_cache": k.to(DEVICE, dtype),
        "v_cache": v.to(DEVICE, dtype),
        "block_tables": tables.to(DEVICE),
        "seq_index": seq_index[shuffle].to(DEVICE, torch.int32),
        "positions": positions[shuffle].to(DEVICE, torch.int32),
        "scale": d**-0.5,
    }


def brute_force(q, k_cache, v_cache, block_tables, seq_index, positions, scale) -> torch.Tensor:
    """The definition, one token and one head at a time, in float64."""
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // nkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        b, pos = int(seq_index[t]), int(positions[t])
        slots = [(int(block_tables[b, j // page_size]), j % page_size) for j in range(pos + 1)]
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
    ("page_size", "nh", "nkv", "d", "dtype"),
    [
        (1, 2, 2, 16, torch.float32),  # group 1
        (3, 4, 2, 64, torch.float32),  # group 2
        (16, 12, 2, 16, torch.float32),  # group 6 (Qwen2.5-1.5B)
        (3, 14, 2, 32, torch.float32),  # group 7 (Qwen2.5-0.5B)
        (16, 2, 1, 128, torch.float32),  # the smaller key block of wide heads
        (16, 4, 2, 64, torch.bfloat16),
        (1, 7, 1, 16, torch.bfloat16),
        (3, 12, 2, 64, torch.bfloat16),
    ],
)
def test_triton_matches_reference(page_size, nh, nkv, d, dtype):
    batch = make_batch(page_size, nh, nkv, d, dtype, seed=100 + page_size * nh + d)
    out = torch.full_like(batch["q"], float("nan"))  # every element must be written
    result = triton_attention(**batch, out=out)
    assert result is out and result.dtype == dtype
    assert_matches(out, reference(**batch), dtype)


def test_triton_takes_int64_positions_and_allocates_its_output():
    batch = make_batch(3, 4, 2, 16, torch.float32, seed=7)
    expected = reference(**batch)
    batch["positions"] = batch["positions"].long()
    assert_matches(triton_attention(**batch), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comparison_rejects_wrong_attention(dtype):
    """The tolerance catches one key too many, and the poison is within reach of a kernel that
    ignored the sequence's end."""
    batch = make_batch(3, 4, 2, 16, dtype, seed=11)
    right = reference(**batch)
    lengths = torch.tensor(LENGTHS, device=DEVICE)[batch["seq_index"].long()]
    one_more = torch.minimum(batch["positions"] + 1, lengths - 1)  # the verify's and prefill's
    assert (one_more > batch["positions"]).any()
    with pytest.raises(AssertionError):
        assert_matches(reference(**{**batch, "positions": one_more}), right, dtype)
    table_end = batch["block_tables"].shape[1] * batch["k_cache"].shape[1] - 1
    whole_table = torch.full_like(batch["positions"], table_end)
    with pytest.raises(AssertionError):
        assert_matches(reference(**{**batch, "positions": whole_table}), right, dtype)


def test_bad_shapes_raise():
    batch = make_batch(3, 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_attention(**{**batch, "q": batch["q"][:, :3]})
    with pytest.raises(ValueError, match="power of two"):
        triton_attention(**{**batch, "q": batch["q"][..., :12].contiguous()})
    with pytest.raises(ValueError, match="out must be"):
        triton_attention(**batch, out=torch.empty_like(batch["q"][:-1]))
