"""The scheduler's unit of work: a `Job` (a request's decode, the KV rows it may hold, its
outcome as a `Future`) and `Cancelled`, how a cancelled one ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from smcspec.models.base import CausalLM


class Cancelled(Exception):
    """The job was cancelled (its client went away or asked to stop)."""


class Job:
    """One unit of work (a request's decode) and its outcome as a `Future`.

    `work(views)` gets one view per scheduled model, in the scheduler's order, and returns the
    result. `rows[m]` sequences of up to `max_length` positions is the most the job keeps in
    model m's cache; the scheduler turns that into KV pages for admission.
    """

    def __init__(
        self,
        work: Callable[[tuple[CausalLM, ...]], Any],
        rows: Sequence[int],
        max_length: int,
    ) -> None:
        self.work = work
        self.rows = tuple(rows)
        self.max_length = max_length
        self.future: Future = Future()
        self.number = -1  # its place in the admission order, set when it starts
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the job at its next forward pass; its pages are freed as its decoder unwinds."""
        self._cancelled.set()
        self.future.cancel()  # only succeeds while the job is still queued

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
