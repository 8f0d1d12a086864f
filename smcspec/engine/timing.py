"""Timing forward passes on this machine: the clock's rules (`drain` before reading it, the
fastest of several reps) and `measure`, the grid of target passes and draft steps a pair's
`engine.costs.StepCosts` are fitted to."""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from smcspec.decoding.base import released, start_cache
from smcspec.engine.costs import StepCosts, from_measurements
from smcspec.models.base import CausalLM


def drain() -> None:
    """Wait for queued GPU work before reading a clock: CUDA calls return before their kernels
    run, so a clock read without it times the launches. A no-op without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_forward(model, context: list[int], batch: int, new_tokens: int, reps: int) -> float:
    """Least seconds (of `reps`, after a warm-up) of one forward of `new_tokens` tokens per row
    at `batch` rows, on a cache holding `context` (cropped back after each timing, so every rep
    sees the same context)."""
    return time_shapes(model, context, batch, [new_tokens], reps)[new_tokens]


def time_shapes(
    model, context: list[int], batch: int, widths: Sequence[int], reps: int, law: bool = False
) -> dict[int, float]:
    """`time_forward` at each of `widths` tokens per row, over one cache (the context fed once).
    law: each pass also takes the log-softmax of its logits, as every round's sampling law does
    (at a 152k vocabulary a real share of a round)."""
    with released() as held:  # a pool too small to profile in gets its pages back
        cache = start_cache(model, torch.tensor(context), batch, held)
        model.forward(torch.tensor([context[-1:]] * batch), cache, 1)  # now holds the context
        length = cache.length
        out = {}
        for width in widths:
            tokens = torch.tensor([context[-width:]] * batch)
            times = []
            for _ in range(reps + 1):
                drain()
                start = time.perf_counter()
                logits = model.forward(tokens, cache, width)
                if law:
                    torch.log_softmax(logits.float(), dim=-1)
                drain()
                times.append(time.perf_counter() - start)
                cache.crop(length)
            # the first is a warm-up; the least of the rest: other work on the machine only
            # ever adds time, so the fastest rep is the closest to what the pass itself costs
            out[width] = min(times[1:])
    return out


def profile_widths(max_draft_tokens: int) -> list[int]:
    """The tokens per row a profile times target passes at: 1, 2, 3, then about doubling to
    K + 1 (the affine fit prices the widths between; fewer shapes, a shorter first start)."""
    widths, t = [], 1
    while t < max_draft_tokens + 1:
        widths.append(t)
        t = t + 1 if t < 3 else 2 * t - 1
    return [*widths, max_draft_tokens + 1]


def measure(
    target: CausalLM,
    draft: CausalLM,
    rows: Sequence[int] = (1, 2, 4, 8),
    max_draft_tokens: int = 8,
    context: int = 128,
    reps: int = 3,
    key: Mapping[str, Any] | None = None,
) -> StepCosts:
    """The least timings of the target at every rows and `profile_widths` tokens per row and of the
    draft's one-token step at every rows, each with its logits' log-softmax (`time_shapes`),
    over a cache holding `context` positions (fed once per model and rows), fitted."""
    for name, value in (("max_draft_tokens", max_draft_tokens), ("reps", reps)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not rows or not all(isinstance(r, int) and r >= 1 for r in rows):
        raise ValueError(f"rows must be integers >= 1, got {rows!r}")
    if not (isinstance(context, int) and context > max_draft_tokens + 1):
        raise ValueError(f"context must be an integer > max_draft_tokens + 1, got {context!r}")
    ids = [i % target.vocab_size for i in range(context)]
    widths = profile_widths(max_draft_tokens)
    target_seen = {
        (r, t): seconds
        for r in rows
        for t, seconds in time_shapes(target, ids, r, widths, reps, law=True).items()
    }
    draft_seen = {r: time_shapes(draft, ids, r, [1], reps, law=True)[1] for r in rows}
    return from_measurements(target_seen, draft_seen, key)
