"""Continuous batching: concurrent requests share forward passes.

Each admitted job runs its decoder in a thread of its own, against views of the models whose
`forward` hands the call to the scheduler and waits. Once every running job is waiting (or has
finished), the scheduler runs the waiting calls to one model as ONE batched pass
(`models.base.forward_many`; the cheaper model first, see `_execute`) and wakes the jobs with
their logits. A job is therefore any
function of the model views: the scheduler knows nothing about the algorithm, only how many KV
pages a job may need at most, which decides admission.

    step:  wait until no job is computing -> one pass over one model's waiting calls -> wake them

Threads: forward passes (which allocate KV pages) run only on the scheduler's thread, while the
jobs whose calls they serve wait; a job's thread touches only its own caches (fork, crop,
release: page references of its own sequences). Page ids come from a thread-safe free list and
sequence ids from an atomic counter, so no two threads ever write the same state.

Failures stay with their job: a call's inputs are checked on the job's thread before they join
a pass (ids in the vocabulary, shapes), and a batched pass that fails anyway is rolled back
(each cache cropped to its length before the pass) and re-run call by call, so only the calls
that fail alone fail. No wait is without end: if the scheduler's thread dies, every waiting
call, queued job and later submission fails with the reason (`alive` turns False), and a job
waiting on a call also checks, once a second, that the thread still lives.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from smcspec.config import EngineLimits
from smcspec.engine import pools
from smcspec.engine.job import Cancelled, Job
from smcspec.models.base import CausalLM, KVCache, PagedModel, forward_many


@dataclass
class _Call:
    model: int
    tokens: torch.Tensor  # [B, T]
    cache: KVCache
    num_logits: int
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None  # [B, num_logits, V]
    error: BaseException | None = None
    fed: int = 0  # tokens per row already run (a long call runs in pieces)
    finished: bool = False
    job: int = -1  # its job's `number`: a pass orders its calls by it
    left_over: bool = False  # waiting since a pass it did not finish in


class _View:
    """A job's `CausalLM` view of model `index`: forward passes go through the scheduler."""

    def __init__(self, scheduler: Scheduler, index: int, job: Job) -> None:
        model = scheduler.models[index]
        self.vocab_size = model.vocab_size
        self.eos_token_ids = model.eos_token_ids
        self.new_cache = model.new_cache
        # A call that wants the logits of every position it feeds cannot be split into pieces;
        # a caller that asks for them over a long input (prompt scoring) keeps to this many
        # tokens a call, so the pass bounds its logits and it shares passes like any prompt.
        self.pass_tokens = scheduler.max_batch_tokens
        self._scheduler, self._index, self._job = scheduler, index, job

    def forward(self, tokens: torch.Tensor, cache: KVCache, num_logits: int) -> torch.Tensor:
        if self._job.cancelled:
            raise Cancelled("the request was cancelled")
        call = _Call(self._index, tokens, cache, num_logits, job=self._job.number)
        return self._scheduler._call(call)


@dataclass
class SchedulerStats:
    """Counters since start, per model: forward passes, rows they carried, seconds they took,
    passes served by a CUDA-graph replay; and jobs by outcome."""

    forwards: list[int]
    rows: list[int]
    seconds: list[float]
    replays: list[int]
    finished: int = 0
    failed: int = 0
    cancelled: int = 0


class Scheduler:
    """Runs jobs over `models` (most expensive first, e.g. (target, draft)) with continuous
    batching.

    `max_running` and `max_batch_tokens` are `EngineLimits`' (None: its defaults).

    Admission: a job starts when at most `max_running` jobs run and, for every model with a
    page pool (`model.pages`, a `kv.pages.PageAllocator`), the pages reserved by running jobs
    plus its own fit in the pool; otherwise it waits in a first-come queue. Models without a
    pool are only limited by `max_running`.

    Chunked prefill: a pass over a model carries at most `max_batch_tokens` tokens (rows x
    tokens): the calls left over from the last pass first, then the others, each group by job
    in admission order (not by which job's thread called first: the same jobs share the same
    passes every run). A call too long for the room left (a prompt) runs in pieces over
    several passes, so one long prompt does not stall every other request's next token. The
    first call always runs, and a call left over goes first next time: every call progresses.
    On a CPU, linears are also fastest per token at a few hundred rows.
    """

    def __init__(
        self,
        models: Sequence[CausalLM],
        max_running: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        given = {"max_running": max_running, "max_batch_tokens": max_batch_tokens}
        # None takes `EngineLimits()`'s value; the limits check the others
        limits = EngineLimits(**{k: v for k, v in given.items() if v is not None})
        self.models = tuple(models)
        self.max_running = limits.max_running
        self.max_batch_tokens = limits.max_batch_tokens
        n = len(self.models)
        self.stats = SchedulerStats([0] * n, [0] * n, [0.0] * n, [0] * n)
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: set[Job] = set()
        self._computing = 0  # running jobs not waiting on a forward pass
        self._admitted = 0  # jobs started so far: the next one's `number`
        self._calls: list[_Call] = []
        self._reserved = [0] * len(self.models)
        self._stopping = False
        self._death: BaseException | None = None  # why the loop ended, if not by shutdown
        self._workers: set[threading.Thread] = set()  # the running jobs' threads
        self._thread = threading.Thread(target=self._loop, name="smcspec-scheduler", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------------

    def capacity(self, index: int) -> int | None:
        """Pages in model `index`'s pool, None when it has none."""
        model = self.models[index]
        return model.pages.num_pages if isinstance(model, PagedModel) else None

    def page_size(self, index: int) -> int | None:
        """Positions per page of model `index`'s pool, None when it has none."""
        model = self.models[index]
        return model.page_size if isinstance(model, PagedModel) else None

    def pages_for(self, rows: Sequence[int], max_length: int) -> list[int]:
        """The most pages a job of `rows` sequences of up to `max_length` positions can hold in
        each model's pool (`pools.pages_for`)."""
        return pools.pages_for(self.models, rows, max_length)

    def submit(self, job: Job) -> Job:
        """Queue `job`; it starts as soon as admission allows. A job that could never fit (more
        pages than a pool holds) is refused with ValueError."""
        return self.submit_all([job])[0]

    def submit_all(self, jobs: Sequence[Job]) -> list[Job]:
        """`submit` for several jobs at once: all are queued, in order, before any starts, so
        the passes they share are the same from run to run (jobs submitted one by one race the
        scheduler for their first pass). Nothing is queued if one is refused."""
        for job in jobs:
            self._refuse_oversized(job)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is shut down")
            if self._death is not None:
                raise self._dead_error()
            self._queue.extend(jobs)
            self._admit()
        return list(jobs)

    def _refuse_oversized(self, job: Job) -> None:
        reason = pools.oversized(self.models, job.rows, job.max_length)
        if reason is not None:
            raise ValueError(reason)

    @property
    def alive(self) -> bool:
        """Whether the scheduler's thread runs (False after shutdown or a fatal fault)."""
        return self._thread.is_alive() and self._death is None

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def shutdown(self) -> None:
        """Cancel everything, stop the scheduler thread and wait for the jobs' threads to unwind:
        a caller that exits after the first failure must not leave a job inside torch at
        interpreter exit, which aborts the process ("terminate called without an active
        exception") after the error it had printed."""
        with self._cond:
            self._stopping = True
            for job in list(self._running) + list(self._queue):
                job.cancel()
            self._queue.clear()
            self._cond.notify_all()
            workers = [t for t in self._workers if t is not threading.current_thread()]
        self._thread.join(timeout=30)
        for worker in workers:  # each stops at its next pass, refused once stopping
            worker.join(timeout=30)

    # -- jobs -------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Start queued jobs in order while they fit (caller holds the lock)."""
        while self._queue and len(self._running) < self.max_running and self._death is None:
            job = self._queue[0]
            if job.future.cancelled():
                self._queue.popleft()
                self.stats.cancelled += 1
                continue
            if not self._fits(job):
                return
            self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                self.stats.cancelled += 1
                continue
            self._running.add(job)
            job.number, self._admitted = self._admitted, self._admitted + 1
            self._reserved = [r + p for r, p in zip(self._reserved, self._pages(job), strict=True)]
            self._computing += 1
            worker = threading.Thread(target=self._run, args=(job,), daemon=True)
            self._workers.add(worker)
            worker.start()

    def _pages(self, job: Job) -> list[int]:
        return self.pages_for(job.rows, job.max_length)

    def _fits(self, job: Job) -> bool:
        for i, need in enumerate(self._pages(job)):
            cap = self.capacity(i)
            if cap is not None and self._reserved[i] + need > cap:
                return False
        return True

    def _run(self, job: Job) -> None:
        views = tuple(_View(self, i, job) for i in range(len(self.models)))
        try:
            result = job.work(views)
        except BaseException as err:  # handed to whoever waits on the future
            job.future.set_exception(err)
            outcome = "cancelled" if isinstance(err, Cancelled) else "failed"
        else:
            job.future.set_result(result)
            outcome = "finished"
        with self._cond:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            self._running.discard(job)
            self._workers.discard(threading.current_thread())
            self._reserved = [r - p for r, p in zip(self._reserved, self._pages(job), strict=True)]
            self._computing -= 1
            self._admit()
            self._cond.notify_all()

    def _call(self, call: _Call) -> torch.Tensor:
        self._check(call)
        with self._cond:
            if self._stopping:
                raise Cancelled("the server is shutting down")
            if self._death is not None:
                raise self._dead_error()
            self._calls.append(call)
            self._computing -= 1
            self._cond.notify_all()
        # woken by the loop, or by its death; the poll covers a thread that died mid-wake-up
        while not call.done.wait(1.0):
            if not self._thread.is_alive():
                raise self._dead_error()
        if call.error is not None:
            raise call.error
        assert call.logits is not None
        return call.logits

    def _check(self, call: _Call) -> None:
        """Refuse, on the job's own thread, a call that would fail the pass it joins."""
        tokens, vocab = call.tokens, self.models[call.model].vocab_size
        if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [rows, positions], both >= 1; got {tokens.shape}")
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        if not 1 <= call.num_logits <= tokens.shape[1]:
            raise ValueError(f"num_logits must be in [1, {tokens.shape[1]}], got {call.num_logits}")
        if tokens.device.type != "cpu":
            # Ids made on the device are the engine's own samples, in [0, V) by construction
            # (`sampling.sample`); reading them back would wait for the device every draft step.
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside model {call.model}'s ids [0, {vocab})")

    def _dead_error(self) -> RuntimeError:
        return RuntimeError(f"the scheduler thread died ({self._death!r}); restart the server")

    # -- batching ---------------------------------------------------------------------------

    def _loop(self) -> None:
        calls: list[_Call] = []
        try:
            while self._step(calls):
                pass
        except BaseException as err:  # a dead loop must fail its waiters, not hang them
            self._die(err, calls)

    def _step(self, calls: list[_Call]) -> bool:
        """One pass; False once shut down. `calls` is filled in place, so a fatal fault can fail
        the calls it was serving."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or (self._calls and not self._computing))
            # left-over calls first, then by job: not by which thread woke first
            calls[:] = sorted(self._calls, key=lambda c: (not c.left_over, c.job))
            self._calls = []
            if self._stopping:
                for call in calls:
                    call.error = Cancelled("the server is shutting down")
                    call.done.set()
                return False
        try:
            finished = self._execute(calls)
        except Exception as err:  # a fault here must fail the waiting calls, not hang them
            for call in calls:
                call.error, call.finished = err, True
            finished = list(calls)
        with self._cond:
            # unfinished calls (pieces still to run) go first next time
            left = [c for c in calls if not c.finished]
            for c in left:
                c.left_over = True
            self._calls = left + self._calls
            self._computing += len(finished)
            calls.clear()
        for call in finished:
            call.done.set()
        return True

    def _die(self, err: BaseException, calls: list[_Call]) -> None:
        """The loop cannot go on: fail the calls in flight and waiting, and the queued jobs."""
        with self._cond:
            self._death = err
            dead = self._dead_error()
            for call in calls + self._calls:
                if not call.done.is_set():
                    call.error = dead
                    call.done.set()
            self._calls = []
            for job in self._queue:
                if not job.future.done():
                    job.future.set_exception(dead)
            self._queue.clear()
            self._cond.notify_all()

    def _execute(self, calls: list[_Call]) -> list[_Call]:
        """One batched forward over (pieces of) the waiting calls of one model; returns the
        calls now complete. The model is the last in `models` that has waiting calls: the
        cheap draft runs first, so jobs gather at the expensive target and share its pass
        (a job's draft phase is at most a few calls, so the target always comes). If the pass
        fails, it is undone and each piece re-run alone: only the pieces that fail alone fail
        (each such job then unwinds, freeing pages)."""
        index = max(c.model for c in calls)
        pieces = self._pieces([c for c in calls if c.model == index])
        start, replays = time.perf_counter(), _replays(self.models[index])
        try:
            logits = self._forward(index, pieces)
        except Exception:
            logits = [self._forward_alone(index, piece) for piece in pieces]
        self.stats.seconds[index] += time.perf_counter() - start
        self.stats.forwards[index] += 1
        # a pass re-run piece by piece counts once, as it does in `forwards`
        self.stats.replays[index] += min(1, _replays(self.models[index]) - replays)
        self.stats.rows[index] += sum(c.tokens.shape[0] for c, _, _ in pieces)
        finished = []
        for (c, _, b), out in zip(pieces, logits, strict=True):
            if out is None:  # failed alone: c.error is set
                c.finished = True
                finished.append(c)
                continue
            c.fed = b
            if b == c.tokens.shape[1]:
                c.logits, c.finished = out, True
                finished.append(c)
        return finished

    def _forward(self, index: int, pieces: list[tuple[_Call, int, int]]) -> list[torch.Tensor]:
        """One pass over `pieces`; if it raises, every cache is cropped back to its length."""
        lengths = [c.cache.length for c, _, _ in pieces]
        feeds = [
            (c.tokens[:, a:b], c.cache, c.num_logits if b == c.tokens.shape[1] else 1)
            for c, a, b in pieces
        ]
        try:
            return forward_many(self.models[index], feeds)
        except Exception:
            for (c, _, _), length in zip(pieces, lengths, strict=True):
                c.cache.crop(length)
            raise

    def _forward_alone(self, index: int, piece: tuple[_Call, int, int]) -> torch.Tensor | None:
        """The piece's logits from a pass of its own; None (and the call's error) if it fails."""
        try:
            return self._forward(index, [piece])[0]
        except Exception as err:
            piece[0].error = err
            return None

    def _pieces(self, calls: list[_Call]) -> list[tuple[_Call, int, int]]:
        """(call, first, end): the token columns of each call that run in this pass, oldest
        call first, within `max_batch_tokens`. A piece that is not a call's last leaves at
        least `num_logits` tokens for the last one, which returns the logits."""
        room = self.max_batch_tokens
        out = []
        for c in calls:
            rows, total = c.tokens.shape
            left = total - c.fed
            take = left if rows * left <= room else min(left - c.num_logits, room // rows)
            if take <= 0:
                if out:
                    continue  # no room in this pass
                take = left  # the oldest call always runs
            out.append((c, c.fed, c.fed + take))
            room -= rows * take
            if room <= 0:
                break
        return out


def _replays(model: CausalLM) -> int:
    """Passes `model` has served by replaying a CUDA graph (0 for a model without graphs)."""
    return getattr(model, "graph_replays", 0)
