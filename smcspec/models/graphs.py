"""CUDA graphs of the steps decoders repeat.

A decoder's steps have a few shapes only: the draft step (B rows x 1 token), the target's
verification (B rows x K + 1 tokens), the autoregressive step (1 x 1). On a GPU a 1.5B model's
step is a few hundred small kernels whose launches cost more than their work; replaying a
captured graph launches them all at once. As in vLLM and nano-vllm, graphs are captured per
batch-size bucket: a batch of B rows runs in the smallest bucket >= B, its padding rows writing
their keys to the cache's scratch page and their logits dropped. Inputs live in static buffers
that each replay reads; the page tables are host-built each step and copied in.

A graph is captured the first time its (bucket, tokens per row, logits per row) is seen; batches
outside the buckets (a long prefill, a ragged batch, more rows than the largest bucket) run
eagerly. The capture itself is a strategy: `cuda_capture` on a GPU, `eager_capture` (replay =
run the function again over the same buffers) wherever graphs do not exist, which is how the
CPU tests check everything here but the CUDA call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from smcspec.kv.cache import PagedKVCache
from smcspec.models.attention import ForwardBatch
from smcspec.models.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MAX_TOKENS_PER_ROW = 16  # a verify of K + 1 <= 16; longer uniform feeds are prefills
# Each graph keeps its logits [rows * t, V] alive (152k-word vocabularies: 0.3 GB in bf16 at
# 1024 rows); bigger batches are wide enough to be compute-bound, where graphs gain little.
MAX_GRAPH_TOKENS = 1024

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def eager_capture(fn: Callable[[], torch.Tensor]) -> Replay:
    """The stand-in: every replay runs `fn` over the static buffers again."""
    return fn


class CudaCapture:
    """Captures into CUDA graphs sharing one memory pool (replays never overlap)."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # cuBLAS workspaces and Triton compilation happen outside
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class _Static:
    """One graph's input buffers (rows = bucket, t tokens per row) and its replay."""

    tokens: torch.Tensor  # [rows * t] int64
    batch: ForwardBatch  # slots, positions [rows * t]; seq_index [rows * t]; tables [rows, P]
    replay: Replay | None = None


def _decode_like(t: int, n: int) -> bool:
    """The steps decoders repeat: a verify (logits at all t <= MAX_TOKENS_PER_ROW positions)
    or a draft step (one logit after one token, or two when the last round's bonus token is
    fed too). A short prefill (one logit after t tokens) would capture a graph per prompt
    length, for a step that runs once."""
    return 1 <= t <= MAX_TOKENS_PER_ROW and (n == t or (n == 1 and t <= 2))


class GraphRunner:
    """Runs uniform decode-like batches (every row appends the same t tokens and wants the same
    logits, see `_decode_like`) of `model` over `kv` through captured graphs."""

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        context_length: int,
        capture: Capture,
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        assert model.attention.paged, "graphs need attention that reads page tables"
        self.model, self.kv, self.capture, self.buckets = model, kv, capture, buckets
        self.width = -(-context_length // kv.page_size)  # page-table columns
        model.rope.pin(self.width * kv.page_size)  # the table must not move after a capture
        self._graphs: dict[tuple[int, int, int], _Static] = {}
        self.replays = 0  # batches served by a graph (for tests and the bench)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    @torch.inference_mode()
    def run(
        self, seqs: list[int], tokens: list[torch.Tensor], num_logits: list[int]
    ) -> list[torch.Tensor] | None:
        """Float32 logits of the last num_logits[b] of tokens[b] ([n, V] each), or None when
        this batch is not a graph's shape (the caller runs it eagerly)."""
        t, n = tokens[0].numel(), num_logits[0]
        bucket = self.bucket(len(seqs))
        uniform = all(x.numel() == t for x in tokens) and all(m == n for m in num_logits)
        if not uniform or bucket is None or not _decode_like(t, n):
            return None
        if bucket * t > MAX_GRAPH_TOKENS:
            return None
        ends = [self.kv.lengths[s] + t for s in seqs]
        if max(ends) > self.width * self.kv.page_size:
            return None
        static = self._graph(bucket, t, n)
        dev = static.tokens.device  # rows from the host and the device may meet here
        rows = torch.stack([x.to(dev, non_blocking=True) for x in tokens])  # [b, t]
        self._load(static, seqs, rows, bucket)
        logits = static.replay()  # [bucket * n, V], in the graph's pool
        self.replays += 1
        # A copy: the pool's memory is the next replay's
        out = logits[: len(seqs) * n].to(torch.float32, copy=True)
        return list(out.view(len(seqs), n, -1))

    def _load(self, static: _Static, seqs: list[int], tokens: torch.Tensor, rows: int) -> None:
        """Reserve the new positions (host page tables) and copy the batch into the buffers in
        four transfers; padding rows write to the scratch page, at positions 0 .. t - 1. Host
        work in Python ints: on a GPU a small step costs about as much as this."""
        b, t = tokens.shape
        kv, ps, pad = self.kv, self.kv.page_size, rows - len(seqs)
        starts = [kv.lengths[s] for s in seqs]
        slots = torch.cat([kv.reserve(s, t) for s in seqs])  # [b * t]
        scratch = [kv.scratch_page * ps + i % ps for i in range(t)]
        positions = [p for s in starts for p in range(s, s + t)] + list(range(t)) * pad
        width = max(len(kv.tables[s]) for s in seqs)
        tables = kv.block_tables(seqs + [None] * pad, width)  # padding rows: all scratch
        dev = static.tokens.device
        static.tokens[: b * t].copy_(tokens.reshape(-1))
        static.tokens[b * t :].zero_()
        host = torch.cat([slots, torch.tensor(scratch * pad, dtype=torch.long)])
        static.batch.slots.copy_(host.to(dev, non_blocking=True))
        host = torch.tensor(positions, dtype=torch.long)
        static.batch.positions.copy_(host.to(dev, non_blocking=True))
        static.batch.block_tables[:, :width].copy_(tables.to(dev, non_blocking=True))

    def _graph(self, rows: int, t: int, n: int) -> _Static:
        key = (rows, t, n)
        if key not in self._graphs:
            self._graphs[key] = self._new(rows, t, n)
        return self._graphs[key]

    @torch.inference_mode()
    def _new(self, rows: int, t: int, n: int) -> _Static:
        """Buffers holding an all-padding batch (so the capture's warm-up runs touch only the
        scratch page), then the capture."""
        dev, kv = self.model.device, self.kv
        offsets = torch.arange(t, device=dev).repeat(rows)
        batch = ForwardBatch(
            slots=kv.scratch_page * kv.page_size + offsets % kv.page_size,
            positions=offsets.clone(),
            seq_index=torch.arange(rows, dtype=torch.int32, device=dev).repeat_interleave(t),
            block_tables=torch.full(
                (rows, self.width), kv.scratch_page, dtype=torch.int32, device=dev
            ),
        )
        static = _Static(torch.zeros(rows * t, dtype=torch.long, device=dev), batch)
        model = self.model

        def step() -> torch.Tensor:
            x = model.hidden(static.tokens, static.batch, kv)  # [rows * t, H]
            last = x.view(rows, t, -1)[:, t - n :].reshape(rows * n, -1)
            return model.logits(last)  # [rows * n, V]

        static.replay = self.capture(step)
        return static
