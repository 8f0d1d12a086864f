"""Attention over the paged KV cache: one interface, several implementations.

A forward pass appends a ragged batch of tokens (sequence b appends counts[b] tokens at
positions starts[b] ..) and every new token attends causally to its own sequence's keys. What
the layers need about that batch travels in one `ForwardBatch`, built once per forward on the
host and copied to the model's device in a handful of transfers.

- `GatherAttention` (the reference, and the CPU's fast path): gathers each sequence's keys into
  a padded [B, Lmax] copy and runs PyTorch's scaled-dot-product attention with a causal mask.
  Where the model's products run on smcspec's CPU kernel, it runs the kernel's attention over
  the same key slots instead (`cpu_attention.cpp`), whose rows do not depend on their pass.
- `PagedAttention`: reads the page tables directly (`paged_attention`): the Triton kernel on
  CUDA, its plain-torch reference elsewhere. Its inputs have shapes fixed by the batch's size
  alone, which is what CUDA graphs need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from smcspec.kv.cache import PagedKVCache
from smcspec.models import paged_attention


@dataclass
class GatherPlan:
    """Index tensors of `GatherAttention`: the padded key slots of each sequence, the padded
    query rows, and the causal mask over them. When every sequence appends the same number of
    tokens (what the decoders do) the flat rows already form a [B, T] grid and the query gather
    is skipped; when moreover T = 1 and all lengths agree, no mask is needed. A prefill of
    every sequence from an empty cache has no mask either, with tmax > 1: its mask would be
    exactly SDPA's is_causal (top-left aligned, which only a start at 0 makes right), and
    without an explicit mask SDPA may pick its flash kernel instead of the O(T^2) float32
    math one."""

    key_slots: torch.Tensor  # [B, Lmax]
    query_index: torch.Tensor | None  # [B, Tmax] rows of the flat batch (padding -> row 0)
    query_rows: torch.Tensor | None  # [total] valid rows of the padded [B * Tmax] output
    mask: torch.Tensor | None  # [B, 1, Tmax, Lmax] True = may attend
    tmax: int
    row_seq: torch.Tensor | None = None  # [total] the sequence (row of key_slots) of each row
    # each sliding window's mask, made by the first layer that needs it (`_window_mask`)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardBatch:
    """What every layer of one forward needs, on the model's device. `total` new tokens."""

    slots: torch.Tensor  # [total] int64 flat KV slot each new key and value is written to
    positions: torch.Tensor  # [total] int64 absolute position of each new token
    seq_index: torch.Tensor | None = None  # [total] int32 row of block_tables (paged only)
    # [B + 1] int32 cumulative token counts (paged only): sequence b's new tokens are the flat
    # rows query_starts[b] .. query_starts[b + 1] - 1, contiguous and in order; a sequence may
    # append no token (a graph's padding row). None: derived from seq_index by the kernel.
    query_starts: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None  # [B, P] int32 page ids (paged only)
    # The most tokens any sequence appends, a host int fixed for the batch's lifetime (a CUDA
    # graph's: the most any pass it replays may bring): it picks the paged kernel's tile. None:
    # the average, which a graph's padding rows make 1.
    max_query_len: int | None = None
    gather: GatherPlan | None = None  # (gather only)
    attention: Attention | None = None  # the implementation for this batch (None: the model's)


class Attention(Protocol):
    name: str
    paged: bool  # reads block tables (else a GatherPlan)
    graph_safe: bool  # no host sync and fixed shapes: may run inside a CUDA graph

    def __call__(
        self, q: torch.Tensor, kv: PagedKVCache, layer: int, batch: ForwardBatch, window: int = 0
    ) -> torch.Tensor:
        """Attention of new queries q [total, nh, d] over the cache (their own keys already
        written), each over its last `window` keys (0: all before it); returns [total, nh, d]."""
        ...


class GatherAttention:
    """`attend`: the CPU kernel's attention (`cpu_linear.KERNEL`'s), which reads the key slots
    itself and computes every row's arithmetic alone, the same bits whatever shares its pass: a
    step's logits are then those of the same row in a verification or beside other requests.
    None: PyTorch's scaled-dot-product attention over gathered keys, whose blocks follow the
    pass's shapes (a row's result moves by ~1e-7 with them)."""

    paged = False
    graph_safe = False

    def __init__(self, attend: Callable[..., torch.Tensor] | None = None) -> None:
        self.attend = attend
        self.name = "gather" if attend is None else "rows"

    @staticmethod
    def plan(kv: PagedKVCache, seqs: list[int], starts: list[int], counts: list[int]) -> GatherPlan:
        """Built on the host, before the tensors move to the device."""
        lengths = [s + n for s, n in zip(starts, counts, strict=True)]
        lmax, tmax, b = max(lengths), max(counts), len(seqs)
        key_slots = torch.zeros(b, lmax, dtype=torch.long)
        for i, seq in enumerate(seqs):
            key_slots[i, : lengths[i]] = kv.slots(seq)
        query_index = query_rows = mask = None
        if min(counts) != tmax:
            query_index = torch.zeros(b, tmax, dtype=torch.long)
            offset = 0
            for i, n in enumerate(counts):
                query_index[i, :n] = torch.arange(offset, offset + n)
                offset += n
            # indices, not a boolean mask: a mask's gather waits for the device to count it
            query_rows = torch.cat(
                [torch.arange(i * tmax, i * tmax + n) for i, n in enumerate(counts)]
            )
        from_empty = max(starts) == 0 and min(counts) == tmax
        if (tmax > 1 and not from_empty) or min(lengths) != lmax:
            q_pos = torch.tensor(starts)[:, None] + torch.arange(tmax)[None, :]  # [B, Tmax]
            k_pos = torch.arange(lmax)[None, None, :]
            # Causal; a valid query never sees past its own sequence's end, and padded query
            # rows are dropped after attention.
            mask = (k_pos <= q_pos[:, :, None])[:, None]
        row_seq = torch.arange(b).repeat_interleave(torch.tensor(counts))
        return GatherPlan(key_slots, query_index, query_rows, mask, tmax, row_seq)

    def __call__(
        self, q: torch.Tensor, kv: PagedKVCache, layer: int, batch: ForwardBatch, window: int = 0
    ) -> torch.Tensor:
        """Scaled-dot-product attention (grouped-query: nh is a multiple of the kv heads)."""
        p = batch.gather
        assert p is not None, "GatherAttention needs a GatherPlan"
        flat_k = kv.k[layer].view(-1, *kv.k.shape[-2:])
        flat_v = kv.v[layer].view(-1, *kv.v.shape[-2:])
        if self.attend is not None:
            scale = q.shape[-1] ** -0.5
            args = (q, flat_k, flat_v, p.key_slots, p.row_seq, batch.positions, scale)
            return self.attend(*args, window)
        keys = flat_k[p.key_slots].transpose(1, 2)  # [B, nkv, Lmax, d]
        values = flat_v[p.key_slots].transpose(1, 2)
        b = p.key_slots.shape[0]
        if p.query_index is None:
            queries = q.view(b, p.tmax, *q.shape[1:]).transpose(1, 2)  # [B, nh, T, d]
        else:
            queries = q[p.query_index].transpose(1, 2)  # [B, nh, Tmax, d]
        mask = p.mask
        causal = mask is None and p.tmax > 1  # a prefill from an empty cache (see plan)
        if 0 < window < p.key_slots.shape[1]:  # some key is out of some query's window
            if window not in p.windows:  # one mask a pass, for every layer of this window
                p.windows[window] = _window_mask(p, batch.positions, window)
            mask, causal = p.windows[window], False
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
        ).transpose(1, 2)  # [B, Tmax, nh, d]
        out = out.reshape(-1, *q.shape[1:])  # [B * Tmax, nh, d]
        return out if p.query_rows is None else out[p.query_rows]  # [total, nh, d] flat order


def _window_mask(p: GatherPlan, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, Tmax, Lmax]: each query sees the keys at its position and the window - 1 before
    it (within its sequence: a key past a sequence's end is past its queries too); the plan's
    padded query rows take row 0's position and are dropped after attention."""
    b, lmax = p.key_slots.shape
    index = p.query_index if p.query_index is not None else torch.arange(b * p.tmax).view(b, -1)
    q_pos = positions[index.to(positions.device)][:, :, None]  # [B, Tmax, 1]
    k_pos = torch.arange(lmax, device=positions.device)[None, None, :]
    return ((k_pos <= q_pos) & (k_pos > q_pos - window))[:, None]


class PagedAttention:
    """Reads keys through the page tables (`paged_attention`); `kernel` is "triton" or
    "reference" (plain torch, the same function, any device). A sliding-window layer's query
    sees its window's last keys: the kernel skips the key tiles below every row's window."""

    paged = True

    def __init__(self, kernel: str) -> None:
        self.name = f"paged-{kernel}"
        self.graph_safe = kernel == "triton"
        self.packs_queries = kernel == "triton"  # see `for_feed`
        fns = {"triton": paged_attention.triton_attention, "reference": paged_attention.reference}
        self._fn = fns[kernel]

    def __call__(
        self, q: torch.Tensor, kv: PagedKVCache, layer: int, batch: ForwardBatch, window: int = 0
    ) -> torch.Tensor:
        assert batch.block_tables is not None and batch.seq_index is not None
        scale = q.shape[-1] ** -0.5
        args = (q, kv.k[layer], kv.v[layer], batch.block_tables, batch.seq_index)
        if self._fn is paged_attention.reference:  # the definition needs no packing hint
            return self._fn(*args, batch.positions, scale, window)
        return self._fn(
            *args, batch.positions, scale, query_starts=batch.query_starts,
            max_query_len=batch.max_query_len, window=window,
        )  # fmt: skip


ATTENTION = ("auto", "gather", "triton", "reference")
# Feeds of at most this many tokens per sequence (decoders' steps: a verify of K + 1 <= 16) stay
# on the paged path, as CUDA graphs need; the graphs' MAX_TOKENS_PER_ROW mirrors it. Longer
# feeds are prefills, routed by `for_feed`.
PAGED_MAX_TOKENS = 16


def for_feed(
    attention: Attention, gather: GatherAttention, starts: list[int], counts: list[int]
) -> Attention:
    """The implementation that serves a feed where sequence b holds starts[b] keys and appends
    counts[b] tokens, `attention` being the model's choice:
    - steps (counts <= PAGED_MAX_TOKENS): `attention` itself;
    - a prefill from an empty cache: the gather path, whose SDPA call is then is_causal with no
      mask (when counts agree), the form SDPA's flash kernel takes;
    - a chunk over a prefix (chunked prefill, a scheduler's prompt chunk): the Triton kernel,
      which packs a sequence's query tokens into its tiles and so reads each key once per block
      of queries, where the gather path's mask would send SDPA to its math kernel and its
      O(tokens x keys) float32 scores. The plain-torch paged reference builds a [tokens, keys,
      heads, d] gather, so with it a prefix chunk takes the gather path too."""
    if not attention.paged or max(counts) <= PAGED_MAX_TOKENS:
        return attention
    if max(starts) == 0 or not getattr(attention, "packs_queries", False):
        return gather
    return attention


def choose(name: str, device: torch.device) -> Attention:
    """`auto`: the Triton kernel on CUDA when Triton imports, the gather path otherwise."""
    if name not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {name!r}")
    if name == "auto":
        use_triton = device.type == "cuda" and paged_attention.triton_available(device)
        name = "triton" if use_triton else "gather"
    if name == "gather":
        return GatherAttention()
    if name == "triton" and not paged_attention.triton_available(device):
        raise ValueError(f"attention triton: Triton cannot run on {device} here")
    return PagedAttention(name)
