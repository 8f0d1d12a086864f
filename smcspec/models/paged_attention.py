"""Causal attention of a flat batch of query tokens over a paged KV pool.

Each query token t of sequence b = seq_index[t] at position positions[t] attends to the keys of
its own sequence at positions 0..positions[t] (its own key is already in the pool):

    out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j,   j = 0..positions[t],

with k_j, v_j read from page block_tables[b, j // page_size], offset j % page_size, kv head
h // (nh // nkv) (grouped-query attention). One flat batch covers prefill, decode and a
speculative verify of K+1 tokens alike.

`reference` is the readable definition in plain torch. `triton_attention` is one Triton kernel
that reads the page table directly and keeps an online softmax (running max and sum in float32),
with no host sync, so it can be captured in a CUDA graph. Triton is optional: it is imported only
when the kernel is first built.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, nh, d]; k_cache, v_cache [num_pages, page_size, nkv, d]; block_tables
    [B, max_pages]; seq_index, positions [T]. Returns out [T, nh, d] in q's dtype."""
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
) -> torch.Tensor:
    """Same contract as `reference`, written into `out` [T, nh, d] (a new tensor if None; a
    fixed one under CUDA-graph capture). One program per (query token, query head); its loop
    bound is read from `positions` on the device, so the launch depends on shapes only."""
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, out)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    _, page_size, num_kv_heads, _ = k_cache.shape
    _kernel()[(num_tokens, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_index,
        positions,
        scale,
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=_block_n(head_dim),
    )
    return out


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> None:
    head_dim, num_kv_heads = q.shape[-1], k_cache.shape[2]
    if head_dim < 1 or head_dim & (head_dim - 1):
        # one tl.arange spans the head, and its length must be a power of two
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
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


def _block_n(head_dim: int) -> int:
    """Keys per loop step: a [BLOCK_N, head_dim] float32 tile of k and one of v stay at 4096
    elements each (32 registers a thread at 4 warps)."""
    return max(16, min(64, 4096 // head_dim))


def _kernel() -> Any:
    """The Triton kernel, imported on first use: importing this module must not need Triton,
    and triton.jit decides between compiler and interpreter when it decorates
    (TRITON_INTERPRET), which happens when `_paged_kernel` is first imported."""
    from smcspec.models._paged_kernel import paged_attention_kernel

    return paged_attention_kernel
