"""KV tensors in a pool of fixed-size pages, addressed through per-sequence page tables.

Pool layout: k, v [layers, num_pages, page_size, kv_heads, head_dim]. A sequence is a page table
plus a length. Resampling never copies KV data: `assign` gives each particle its ancestor's table
(taking references). Before a sequence appends into a last page that other sequences share, that
one page is copied (copy on write), so no sequence ever sees another's tokens.

The pool holds one page more than the allocator hands out: `scratch_page`, which no sequence
owns. A batch padded to a fixed shape (a CUDA graph's) writes its padding rows' keys there.
Page tables and lengths live on the host; the tensors live on `device`.

A model whose every layer attends to a sliding window never reads a key again once it has
fallen below the window of every query still to come: `forget_before` returns such pages to
the pool, their table entries pointing at the scratch page (positions keep their pages' places,
and no attention path reads below a query's window). `forgotten[seq]` is the position below
which a sequence's keys are gone; a pass that would need one is refused (`check_kept`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from smcspec.kv.pages import PageAllocator


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.scratch_page = num_pages
        self.device = torch.device(device)
        shape = (layers, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = _zeros(shape, dtype, self.device)
        self.v = _zeros(shape, dtype, self.device)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.forgotten: dict[int, int] = {}  # keys below this position are freed
        # Sequence ids from a C-level counter: taking one is atomic, so threads that open
        # sequences at once (a scheduler's jobs) never get the same id.
        self._ids = itertools.count()

    # -- sequences -------------------------------------------------------------------------

    def new_sequence(self) -> int:
        seq = next(self._ids)
        self.tables[seq] = []
        self.lengths[seq] = 0
        self.forgotten[seq] = 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of `seq`'s pages (and tokens)."""
        child = self.new_sequence()
        self.tables[child] = self.allocator.fork(self.tables[seq])
        self.lengths[child] = self.lengths[seq]
        self.forgotten[child] = self.forgotten[seq]
        return child

    def assign(self, seqs: list[int], ancestors: list[int]) -> None:
        """Resampling: seqs[i] becomes a copy of ancestors[i] (given as sequence ids), all at
        once, by page-table copies and reference counts only."""
        new_tables = [self.allocator.fork(self.tables[a]) for a in ancestors]
        kept = [(self.lengths[a], self.forgotten[a]) for a in ancestors]
        for seq, table, (length, floor) in zip(seqs, new_tables, kept, strict=True):
            self.allocator.release(self.tables[seq])
            self.tables[seq] = table
            self.lengths[seq] = length
            self.forgotten[seq] = floor

    def truncate(self, seq: int, length: int) -> None:
        """Forget positions >= length (speculative rollback); frees pages no longer needed."""
        assert 0 <= length <= self.lengths[seq]
        keep = -(-length // self.page_size)
        self.allocator.release(self.tables[seq][keep:])
        del self.tables[seq][keep:]
        self.lengths[seq] = length
        self.forgotten[seq] = min(self.forgotten[seq], length)  # what is left below is gone

    def release(self, seq: int) -> None:
        self.allocator.release(self.tables.pop(seq))
        del self.lengths[seq]
        del self.forgotten[seq]

    def forget_before(self, seq: int, position: int) -> None:
        """Return to the pool the pages of `seq` that hold only positions below `position`
        (their entries become the scratch page): keys no query to come will read."""
        table, ps = self.tables[seq], self.page_size
        whole = min(max(position, 0) // ps, len(table))
        gone = [p for p in table[:whole] if p != self.scratch_page]
        if not gone:
            return
        self.allocator.release(gone)
        table[:whole] = [self.scratch_page] * whole
        self.forgotten[seq] = max(self.forgotten[seq], whole * ps)

    def check_kept(self, seq: int, first_key: int) -> None:
        """Refuse a pass whose queries need keys from `first_key` on where they were freed."""
        if max(first_key, 0) < self.forgotten[seq]:
            raise ValueError(
                f"sequence {seq} needs keys from position {first_key}, but those below "
                f"{self.forgotten[seq]} fell out of the sliding window and were freed (a "
                "rollback longer than the cache keeps behind the window)"
            )

    # -- data ------------------------------------------------------------------------------

    def reserve(self, seq: int, n: int) -> torch.Tensor:
        """Make room for n more positions of `seq` and return their flat slot ids [n]
        (slot = page * page_size + offset). Raises OutOfPages, leaving `seq` unchanged."""
        length, table = self.lengths[seq], self.tables[seq]
        needed = -(-(length + n) // self.page_size) - len(table)
        partial = length % self.page_size != 0
        # a last page forgotten (after a rollback into freed keys) is replaced, not written
        lost = partial and table[-1] == self.scratch_page
        cow = partial and not lost and self.allocator.refs(table[-1]) > 1
        if needed + int(cow or lost) > self.allocator.free_pages:
            from smcspec.kv.pages import OutOfPages

            extra, free = needed + int(cow or lost), self.allocator.free_pages
            raise OutOfPages(f"sequence {seq} needs {extra} pages, {free} free")
        if cow:
            self._copy_last_page(seq)
        elif lost:
            table[-1] = self.allocator.allocate()
        for _ in range(needed):
            table.append(self.allocator.allocate())
        ps = self.page_size
        # Python ints, one tensor at the end: a decode step reserves a handful of slots, and
        # tensor ops per slot would cost more than the step's own host work on a GPU.
        slots = [table[p // ps] * ps + p % ps for p in range(length, length + n)]
        self.lengths[seq] = length + n
        return torch.tensor(slots, dtype=torch.long)

    def _copy_last_page(self, seq: int) -> None:
        table = self.tables[seq]
        shared = table[-1]
        fresh = self.allocator.allocate()
        self.k[:, fresh] = self.k[:, shared]
        self.v[:, fresh] = self.v[:, shared]
        self.allocator.dec_ref(shared)
        table[-1] = fresh

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, kv_heads, head_dim] at flat slots [n]."""
        flat_k = self.k[layer].view(-1, *self.k.shape[-2:])
        flat_v = self.v[layer].view(-1, *self.v.shape[-2:])
        flat_k[slots] = k
        flat_v[slots] = v

    def slots(self, seq: int) -> torch.Tensor:
        """Flat slot ids of all positions of `seq`, in order [length]."""
        positions = torch.arange(self.lengths[seq])
        pages = torch.tensor(self.tables[seq], dtype=torch.long)
        if positions.numel() == 0:
            return positions
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def block_tables(self, seqs: list[int | None], width: int) -> torch.Tensor:
        """Page tables of `seqs` as a host tensor [len(seqs), width] int32, each padded with the
        scratch page (never read: attention stops at a sequence's length); None gives a row of
        scratch pages (a padding row of a fixed-shape batch)."""
        pad = [self.scratch_page] * width
        rows = [(pad if seq is None else self.tables[seq] + pad)[:width] for seq in seqs]
        return torch.tensor(rows, dtype=torch.int32).view(len(seqs), width)

    def gather(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous k, v [length, kv_heads, head_dim] of one sequence."""
        idx = self.slots(seq).to(self.device)
        flat_k = self.k[layer].view(-1, *self.k.shape[-2:])
        flat_v = self.v[layer].view(-1, *self.v.shape[-2:])
        return flat_k[idx], flat_v[idx]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one position over all layers."""
        return self.k[:, 0, 0].numel() * self.k.element_size() * 2

    def kv_bytes_in_use(self) -> int:
        return self.allocator.used_pages * self.page_size * self.bytes_per_token

    def kv_bytes_peak(self) -> int:
        return self.allocator.peak_used * self.page_size * self.bytes_per_token


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where they are written. On the CPU a large fresh anonymous
    mapping (numpy's calloc) is zero without being touched, and a pool of thousands of pages is
    mostly never written (torch.zeros would write, so hold, all of it)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
