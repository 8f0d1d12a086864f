"""CUDA graphs of the decoders' steps, keyed by the batch's total token count.

A decoder's step is small: a draft step (1 or 2 tokens a row), a verify (K + 1 tokens a row).
On a GPU a 1.5B model's step is a few hundred small kernels whose launches cost more than their
work; replaying a captured graph launches them all at once. Under the scheduler one pass mixes
requests at different phases (one job's first draft step feeds 2 tokens a row, another's 1;
jobs verify different K), so a graph serves a FLAT RAGGED batch: any rows with 1 ..
MAX_TOKENS_PER_ROW tokens each and any logits count each, as long as their total fits the
graph's token bucket T. As in vLLM, the batch is padded to the smallest bucket >= its total:

    rows 0 .. b - 1          the batch's sequences, their tokens contiguous and in order
    rows b .. b + pad - 1    one padding token each, at position 0 of the scratch page
    rows b + pad .. T - 1    no token (query_starts repeats T)

Every row holds at least one token, so a bucket of T tokens needs at most T rows. The logits of
each row's last num_logits[b] positions are gathered through a static index (padding entries
point at row 0) into one float32 output that all graphs share: only the last replay's is read.

A bucket has two graphs, as the attention's tile follows the longest row a graph may meet
(`ForwardBatch.max_query_len`, `paged_attention.plan`), which T rows of padding would otherwise
hide: "steps" (every row <= STEP_TOKENS: draft steps, AR) keeps the narrow decode tile, and
"verify" (a row of K + 1 > STEP_TOKENS tokens) the wide one that reads each sequence's keys
once per kv head, not once per few tokens. `run` picks by the batch's longest row.

Graphs are captured at start-up (`capture_all`, which `native.NativeCausalLM` calls once),
never inside a live pass: a batch with no captured bucket (more tokens than the largest, a row
longer than MAX_TOKENS_PER_ROW: a prefill) runs eagerly. The capture itself is a strategy:
`CudaCapture` on a GPU, `eager_capture` (replay = run the function again over the same buffers)
wherever graphs do not exist, which is how the CPU tests check everything here but the CUDA call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from smcspec.kv.cache import PagedKVCache
from smcspec.models.attention import ForwardBatch
from smcspec.models.llama import LlamaModel

# Total tokens of a pass. The scheduler's passes carry up to 256 tokens (max_batch_tokens) plus
# its oldest call. Padding is under a third of a pass past 16 tokens (under half below, where a
# step is the weights' read whatever its size).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
MAX_TOKENS_PER_ROW = 16  # a verify of K + 1 <= 16 (attention.PAGED_MAX_TOKENS); more: a prefill
STEP_TOKENS = 2  # a draft step's most tokens a row (the first of a round may feed two)

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def eager_capture(fn: Callable[[], torch.Tensor]) -> Replay:
    """The stand-in: every replay runs `fn` over the static buffers again."""
    return fn


class CudaCapture:
    """Captures into CUDA graphs sharing one memory pool (replays never overlap, and no graph's
    output lives in the pool, so a graph's intermediates may reuse another's memory)."""

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
        # thread_local: a CUDA call from another thread (a server's) during the capture must not
        # invalidate it; the scheduler's invariant (no job computes during a pass) holds anyway.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class _Buffers:
    """The inputs every graph reads (graph T reads the first T rows of each) and the output
    they write. On the device they are the graphs' static buffers; on the host, the staging
    copies they are loaded from (pinned on CUDA, so each load is one asynchronous copy)."""

    tokens: torch.Tensor  # [Tmax] int64
    slots: torch.Tensor  # [Tmax] int64
    positions: torch.Tensor  # [Tmax] int64
    seq_index: torch.Tensor  # [Tmax] int32
    query_starts: torch.Tensor  # [Tmax + 1] int32
    block_tables: torch.Tensor  # device [Tmax, W] int32; host [Tmax * W] (any [rows, w] prefix)
    logit_index: torch.Tensor  # [Tmax] int64 flat rows whose logits are wanted

    @classmethod
    def padding(
        cls, tmax: int, width: int, scratch_page: int, page_size: int, device: torch.device,
        staging: bool = False, pin: bool = False,
    ) -> _Buffers:  # fmt: skip
        """An all-padding batch: token i is row i's only token, at position 0 of the scratch
        page, so a capture's warm-up runs write nothing but the scratch page. `staging`: the
        host copy, its tables flat (any [rows, width] prefix is contiguous); `pin` it when the
        graphs run on CUDA."""
        where = torch.device("cpu") if staging else device

        def make(t: torch.Tensor) -> torch.Tensor:
            t = t.to(where)
            return t.pin_memory() if pin else t

        tables = (tmax * width,) if staging else (tmax, width)
        return cls(
            tokens=make(torch.zeros(tmax, dtype=torch.long)),
            slots=make(torch.full((tmax,), scratch_page * page_size, dtype=torch.long)),
            positions=make(torch.zeros(tmax, dtype=torch.long)),
            seq_index=make(torch.arange(tmax, dtype=torch.int32)),
            query_starts=make(torch.arange(tmax + 1, dtype=torch.int32)),
            block_tables=make(torch.full(tables, scratch_page, dtype=torch.int32)),
            logit_index=make(torch.zeros(tmax, dtype=torch.long)),
        )


@dataclass
class _Plan:
    """One pass laid out on the host as the graph of bucket `tokens` reads it."""

    tokens: int  # the bucket T
    rows: int  # table rows written: the batch's b plus one per padding token
    width: int  # table columns written
    wants: list[int]  # logits per sequence


class GraphRunner:
    """Runs decode-like ragged batches (every row 1 .. MAX_TOKENS_PER_ROW tokens) of `model`
    over `kv` through graphs captured per token bucket and longest row (`row_limit`).
    `captures` and `replays` count graphs captured and passes served by one."""

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        context_length: int,
        capture: Capture,
        buckets: tuple[int, ...] = TOKEN_BUCKETS,
    ) -> None:
        assert model.attention.paged, "graphs need attention that reads page tables"
        if not buckets or min(buckets) < 1 or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"graph buckets must be increasing token counts >= 1, got {buckets}")
        self.model, self.kv, self.capture, self.buckets = model, kv, capture, tuple(buckets)
        self.width = -(-context_length // kv.page_size)  # page-table columns
        model.rope.pin(self.width * kv.page_size)  # the table must not move after a capture
        self._replays: dict[tuple[int, int], Replay] = {}  # (bucket, row limit) -> graph
        self.captures = 0
        self.replays = 0
        dev, tmax = model.device, self.buckets[-1]
        pad = (tmax, self.width, kv.scratch_page, kv.page_size)
        self._static = _Buffers.padding(*pad, dev)
        self._host = _Buffers.padding(*pad, dev, staging=True, pin=dev.type == "cuda")
        self._out = torch.zeros(tmax, model.config.vocab_size, dtype=torch.float32, device=dev)
        # The host may run a pass ahead of the device: before it rewrites the staging buffers,
        # the device must have read them (the last load's copies), not finished the pass.
        self._loaded = torch.cuda.Event() if dev.type == "cuda" else None

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    @staticmethod
    def row_limit(longest: int) -> int:
        """The longest row of the graph that serves a batch whose longest row is `longest`."""
        return STEP_TOKENS if longest <= STEP_TOKENS else MAX_TOKENS_PER_ROW

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture a steps and a verify graph per bucket (no verify graph under
        STEP_TOKENS + 1 tokens: no verify fits), largest first (smaller ones then reuse its
        pool's memory), over all-padding buffers. Once, at start-up: a capture costs a
        synchronize and tens of milliseconds, which a live pass must never wait for."""
        for tokens in reversed(self.buckets):
            limits = (MAX_TOKENS_PER_ROW, STEP_TOKENS) if tokens > STEP_TOKENS else (STEP_TOKENS,)
            for limit in limits:
                if (tokens, limit) not in self._replays:
                    self._replays[tokens, limit] = self.capture(self._step(tokens, limit))
                    self.captures += 1

    def _step(self, tokens: int, limit: int) -> Callable[[], torch.Tensor]:
        s, model, kv = self._static, self.model, self.kv
        batch = ForwardBatch(
            slots=s.slots[:tokens],
            positions=s.positions[:tokens],
            seq_index=s.seq_index[:tokens],
            query_starts=s.query_starts[: tokens + 1],
            block_tables=s.block_tables[:tokens],
            max_query_len=min(limit, tokens),  # no row holds more than the bucket
        )
        out = self._out[:tokens]

        def step() -> torch.Tensor:
            x = model.hidden(s.tokens[:tokens], batch, kv)  # [T, H]
            out.copy_(model.logits(x[s.logit_index[:tokens]]))  # [T, V], float32
            return out

        return step

    @torch.inference_mode()
    def run(
        self, seqs: list[int], tokens: list[torch.Tensor], num_logits: list[int]
    ) -> list[torch.Tensor] | None:
        """Float32 logits of the last min(num_logits[b], len(tokens[b])) of tokens[b] ([n, V]
        each), or None when no captured graph fits this batch (the caller runs it eagerly)."""
        counts = [x.numel() for x in tokens]
        key = (self.bucket(sum(counts)), self.row_limit(max(counts)))
        if key not in self._replays or not self._fits(seqs, counts):
            return None
        plan = self._load(seqs, tokens, counts, num_logits, key[0])
        logits = self._replays[key]()  # [T, V]
        self.replays += 1
        # a copy: the next replay writes the same output
        return list(logits[: sum(plan.wants)].clone().split(plan.wants))

    def _fits(self, seqs: list[int], counts: list[int]) -> bool:
        if min(counts) < 1 or max(counts) > MAX_TOKENS_PER_ROW:
            return False
        lengths = [self.kv.lengths[s] for s in seqs]
        ends = [n + c for n, c in zip(lengths, counts, strict=True)]
        if max(ends) > self.width * self.kv.page_size:  # past the tables (the context)
            return False
        # int8 models compute position 0 apart (LlamaModel.forward_ragged): leave it to them
        return self.model.dtype != "int8" or min(lengths) > 0

    def _load(
        self,
        seqs: list[int],
        tokens: list[torch.Tensor],
        counts: list[int],
        num_logits: list[int],
        bucket: int,
    ) -> _Plan:
        """Reserve the new positions (host page tables), lay the padded batch out in the
        staging buffers and copy each into its static buffer once. Host work in Python ints:
        on a GPU a small step costs about as much as this."""
        kv, b, total = self.kv, len(seqs), sum(counts)
        pad = bucket - total
        starts = [kv.lengths[s] for s in seqs]
        self.model.forget_old_keys(kv, seqs, starts)
        slots = torch.cat([kv.reserve(s, n) for s, n in zip(seqs, counts, strict=True)])
        ends = torch.tensor(counts + [1] * pad).cumsum(0).tolist()  # query_starts[1:]
        qs = [0, *ends] + [bucket] * (bucket - b - pad)  # [T + 1]
        wants = [min(n, c) for n, c in zip(num_logits, counts, strict=True)]
        index = [i for e, n in zip(ends[:b], wants, strict=True) for i in range(e - n, e)]
        width = max(len(kv.tables[s]) for s in seqs)
        plan = _Plan(bucket, b + pad, width, wants)
        if self._loaded is not None:
            self._loaded.synchronize()
        h = self._host
        h.slots[:total] = slots
        h.slots[total:bucket] = kv.scratch_page * kv.page_size
        h.positions[:bucket] = torch.tensor(
            [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)] + [0] * pad
        )
        rows = [r for r, n in enumerate(counts) for _ in range(n)] + list(range(b, b + pad))
        h.seq_index[:bucket] = torch.tensor(rows, dtype=torch.int32)
        h.query_starts[: bucket + 1] = torch.tensor(qs, dtype=torch.int32)
        h.logit_index[:bucket] = torch.tensor(index + [0] * (bucket - len(index)))
        # Padding rows read column 0 only (position 0), which is the scratch page. Columns >= width
        # and rows past b + pad keep the ids of earlier passes: nothing reads them (a sequence
        # reads the columns of its own pages, < width; a row with no token reads none), and
        # they are valid page ids anyway. (Only the reference kernel touches them, masked.)
        tables = h.block_tables[: plan.rows * width].view(plan.rows, width)
        tables.copy_(kv.block_tables(seqs + [None] * pad, width))
        self._copy_in(plan, total, tokens)
        return plan

    def _copy_in(self, plan: _Plan, total: int, tokens: list[torch.Tensor]) -> None:
        """One asynchronous copy per static buffer (tokens made on the device are gathered
        there). Padding tokens keep earlier ids: any valid id will do."""
        s, h, t, dev = self._static, self._host, plan.tokens, self._static.tokens.device
        for name in ("slots", "positions", "seq_index", "logit_index"):
            getattr(s, name)[:t].copy_(getattr(h, name)[:t], non_blocking=True)
        s.query_starts[: t + 1].copy_(h.query_starts[: t + 1], non_blocking=True)
        tables = h.block_tables[: plan.rows * plan.width].view(plan.rows, plan.width)
        s.block_tables[: plan.rows, : plan.width].copy_(tables, non_blocking=True)
        here = [x.device == dev for x in tokens]
        if all(here):  # decode steps: sampled ids already on the device
            torch.cat([x.long() for x in tokens], out=s.tokens[:total])
        else:
            ends = torch.tensor([x.numel() for x in tokens]).cumsum(0).tolist()
            for x, end, on_device in zip(tokens, ends, here, strict=True):
                if not on_device:
                    h.tokens[end - x.numel() : end] = x
            s.tokens[:total].copy_(h.tokens[:total], non_blocking=True)
            for x, end, on_device in zip(tokens, ends, here, strict=True):
                if on_device:
                    s.tokens[end - x.numel() : end] = x
        if self._loaded is not None:
            self._loaded.record()
