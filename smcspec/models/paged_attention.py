"""Causal attention of a flat batch of query tokens over a paged KV pool.

Each query token t of sequence b = seq_index[t] at position positions[t] attends to the keys of
its own sequence at positions 0..positions[t] (its own key is already in the pool):

    out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j,   j = 0..positions[t],

with k_j, v_j read from page block_tables[b, j // page_size], offset j % page_size, kv head
h // (nh // nkv) (grouped-query attention). One flat batch covers prefill, decode and a
speculative verify of K+1 tokens alike. Sequence b's tokens are the contiguous flat rows
query_starts[b] .. query_starts[b + 1] - 1 (ForwardBatch.query_starts).

`reference` is the readable definition in plain torch. `triton_attention` is the fast path, with
no host sync and a launch fixed by shapes alone, so it can be captured in a CUDA graph. Triton
is optional: it is imported only when the kernel is first built.

Tiling. A program takes BLOCK_Q query tokens of ONE sequence and the GROUP query heads that
share one kv head, packed as the M = BLOCK_Q * GROUP (padded to BLOCK_M >= 16) rows of a
[BLOCK_M, d] tile, so each K/V tile read through the page table serves all of them, and
q K^T and P V are tensor-core dots ([M, d] x [d, N], [M, N] x [N, d]). Scores run through an
online softmax in float32. The grid is fixed by shapes alone:

    (total // BLOCK_Q + B q-blocks) x (kv heads) x (S splits),

sequence b owning rows query_starts[b] // BLOCK_Q + b .. (enough for its cdiv(n_b, BLOCK_Q)
blocks; a program finds its b by binary search, and spare rows exit at once).

Split-KV (flash-decoding). When q-blocks x kv heads cannot fill the GPU, split s of S takes an
equal share of whole key tiles of 0..max(positions in the q-block), computed on the device, and
writes its partial state: m_s = max score, z_s = sum_j exp(score_j - m_s),
acc_s = sum_j exp(score_j - m_s) v_j (an empty split: m_s = -inf, z_s = 0, acc_s = 0). A second
small kernel merges them exactly:

    out = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) z_s,   m = max_s m_s,

since exp(m_s - m) rescales each split's terms to the common max. S = 1 writes out directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# The GPU the engine targets (an H200) when no CUDA device says otherwise: the split count of
# interpreter runs then matches the one the GPU gets.
DEFAULT_SMS = 132
MAX_SPLITS = 16
# the kernel's reach of a layer without a window: more keys than any cache holds
NO_WINDOW = 1 << 30


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [T, nh, d]; k_cache, v_cache [num_pages, page_size, nkv, d]; block_tables
    [B, max_pages]; seq_index, positions [T]. Each token attends to the keys at and before its
    position, the last `window` of them where window > 0 (a sliding-window layer). Returns out
    [T, nh, d] in q's dtype."""
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // nkv
    key_pos = torch.arange(int(positions.max()) + 1, device=q.device)  # [L]
    # Every token gathers L keys; those past its own position may come from unused table
    # entries (any valid page), and the mask below removes them before the softmax.
    pages = block_tables.long()[seq_index.long()][:, key_pos // page_size]  # [T, L]
    offsets = key_pos % page_size  # [L]
    k = k_cache[pages, offsets].float().repeat_interleave(group, dim=2)  # [T, L, nh, d]
    v = v_cache[pages, offsets].float().repeat_interleave(group, dim=2)  # [T, L, nh, d]
    scores = torch.einsum("thd,tlhd->thl", q.float(), k) * scale  # [T, nh, L]
    causal = key_pos[None, :] <= positions.long()[:, None]  # [T, L]
    if window > 0:
        causal &= key_pos[None, :] > positions.long()[:, None] - window
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [T, nh, L]
    return torch.einsum("thl,tlhd->thd", probs, v).to(q.dtype)


def triton_available(device: torch.device | str) -> bool:
    """Whether `triton_attention` can run on tensors of `device`: Triton compiles for CUDA, and
    its own interpreter (TRITON_INTERPRET=1, Triton's switch, not ours) runs it on the CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    query_starts: torch.Tensor | None = None,
    splits: int | None = None,
    max_query_len: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Same contract as `reference` (`window` too), written into `out` [T, nh, d] (a new tensor
    if None; a fixed one under CUDA-graph capture). `query_starts` [B + 1] (B = block_tables
    rows); None: derived on the device from seq_index, which must then be sorted. `splits`
    forces S (tests); None: `plan` picks it from the shapes. `max_query_len`: a bound on any
    sequence's token count, known on the host, which picks the tile (`plan`); None: the
    average."""
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, out, splits)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    query_starts = _query_starts(seq_index, num_seqs, query_starts)
    launch = plan(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_dim,
        block_tables.shape[1] * page_size, splits=splits, sm_count=_sm_count(q.device),
        dtype=q.dtype, max_query_len=max_query_len,
    )  # fmt: skip
    part_acc = part_m = part_z = out  # unused (never dereferenced) when S = 1
    if launch.splits > 1:
        part_m = torch.empty(launch.splits, num_tokens, num_heads, device=q.device)
        part_z = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, head_dim, device=q.device)
    attention_kernel, merge_kernel = _kernels()
    attention_kernel[launch.grid](
        q, k_cache, v_cache, out, part_acc, part_m, part_z, block_tables, query_starts,
        positions, scale * _LOG2_E, window if window > 0 else NO_WINDOW, num_seqs, num_tokens,
        *q.stride()[:2], *out.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=_head_pad(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_Q=launch.block_q, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        SPLITS=launch.splits, PRECISION=_precision(q.dtype), DOT_FP32=_interpreted(),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if launch.splits > 1:
        merge_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_z, out, num_tokens, num_heads, *out.stride()[:2],
            HEAD_DIM=head_dim, HEAD_PAD=_head_pad(head_dim), SPLITS=launch.splits,
            SPLITS_PAD=_pow2(launch.splits),
        )  # fmt: skip
    return out


def _query_starts(
    seq_index: torch.Tensor, num_seqs: int, given: torch.Tensor | None
) -> torch.Tensor:
    """Each sequence's first flat row, and the total [B + 1]: `given` checked, or derived
    from the sorted seq_index by searchsorted (not bincount + cumsum with a host-read size:
    no sync, graph-safe)."""
    if given is not None:
        if tuple(given.shape) != (num_seqs + 1,):
            raise ValueError(f"query_starts must be [{num_seqs + 1}], got {tuple(given.shape)}")
        return given
    rows = torch.arange(num_seqs + 1, dtype=seq_index.dtype, device=seq_index.device)
    return torch.searchsorted(seq_index, rows).to(torch.int32)


@dataclass(frozen=True)
class Launch:
    """How `triton_attention` launches for given shapes (what the AOT compile reproduces)."""

    block_q: int  # query tokens of one sequence per program
    block_m: int  # tile rows: block_q * GROUP, padded to a power of two >= 16
    block_n: int  # keys per loop step
    splits: int  # S, programs sharing one q-block's keys
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]  # (q-blocks, kv heads, splits)


def plan(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_keys: int,
    *,
    splits: int | None = None,
    sm_count: int = DEFAULT_SMS,
    dtype: torch.dtype = torch.bfloat16,
    max_query_len: int | None = None,
) -> Launch:
    """The launch for a batch of these shapes (never its contents: CUDA graphs replay it).

    A decode step (one token a sequence) gets 16 rows, enough for a GROUP <= 16; a verify
    (K + 1 tokens) or a prefill chunk gets 64, so a 7-head group's 9-token verify is a single
    q-block and each K/V tile is read once per (sequence, kv head) instead of once per token
    and head. The tokens a sequence brings are `max_query_len` when the caller knows them (a
    CUDA graph's padded batch has as many rows as tokens, whose average would call its verify
    a decode step), else the average, cdiv(num_tokens, num_seqs). float32 (the correctness
    runs) keeps 16 rows: its three-pass ("tf32x3") 64-row dots need more registers than a
    thread has (ptxas spills for sm_90). S is chosen so programs reach about twice the SMs, at
    most MAX_SPLITS and at most one split per key tile of the table (`max_keys`).

    num_stages: the loads of the next key tiles overlap the dots (cp.async on sm_90); two
    stages of 16-row tiles already keep ~100 KB in flight an SM (6 CTAs x 16 KB), and a third
    makes ptxas spill a few bytes; 64-row tiles take three without spilling."""
    if max_query_len is not None and max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    group = num_heads // num_kv_heads
    per_seq = -(-num_tokens // max(num_seqs, 1)) if max_query_len is None else max_query_len
    rows_per_seq = per_seq * group
    wide = rows_per_seq > 16 and dtype != torch.float32
    block_m = max(64 if wide else 16, _pow2(group))
    block_q = block_m // group
    block_n = 64 if head_dim <= 64 else 32
    q_blocks = num_tokens // block_q + num_seqs
    if splits is None:
        tiles = -(-max_keys // block_n)
        splits = max(1, min(MAX_SPLITS, tiles, -(-2 * sm_count // (q_blocks * num_kv_heads))))
    stages = 2 if block_m == 16 else 3
    return Launch(block_q, block_m, block_n, splits, 4, stages, (q_blocks, num_kv_heads, splits))


def _interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (its own switch, read when the kernel module
    is first imported): its bf16 tl.dot needs the DOT_FP32 upcast, a GPU must not get it (no
    bf16 tensor cores), whatever device the tensors are on."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    splits: int | None,
) -> None:
    num_kv_heads = k_cache.shape[2]
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)}")
    # the kernel steps through head_dim and a table row with unit stride
    if {q.stride(-1), out.stride(-1), k_cache.stride(-1)} != {1}:
        raise ValueError("q, out and the caches must be contiguous along head_dim")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")


_LOG2_E = 1.4426950408889634  # the kernel's scores are in base 2 (exp2 is the fast one)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _head_pad(head_dim: int) -> int:
    """The tile's head width: tl.arange spans a power of two, and tl.dot needs K >= 16."""
    return max(16, _pow2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    """float32 keeps about float32's accuracy in the dots: the GPU checks compare float32 runs
    with a 1e-5 tolerance that one TF32 product (a 10-bit mantissa) would break. "tf32x3" splits
    each operand into two TF32 parts and adds three tensor-core products (error ~2^-22); "ieee"
    would be exact but runs on FMA units and spills hundreds of bytes a thread on sm_90. bf16
    operands are exact on tensor cores already."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernels() -> tuple[Any, Any]:
    """The Triton kernels, imported on first use: importing this module must not need Triton,
    and triton.jit decides between compiler and interpreter when it decorates
    (TRITON_INTERPRET), which happens when `_paged_kernel` is first imported."""
    from smcspec.models._paged_kernel import merge_splits_kernel, paged_attention_kernel

    return paged_attention_kernel, merge_splits_kernel
