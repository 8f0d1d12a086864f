"""`smcspec bench roofline`: the paper's speed model, fitted to this machine.

Memory-bound model (the paper): a target pass costs the same for any batch, a draft step costs
rho times a target step, so SMC-SD commits K+1 tokens for K draft steps and one target pass:
    S_mem = (K + 1) / (rho K + 1),   rho = t_draft(1) / t_target(1 token).
Measured-cost model: the same round with the costs this machine actually has, including the
compute-bound penalty of wide batches:
    S_meas = (K + 1) t_target(1) / (K t_draft(N) + t_target(N x (K+1))).
Both are set beside the end-to-end speed-up, measured or read from a `bench speed` result file.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from smcspec.bench import machine
from smcspec.bench.results import measurements
from smcspec.config import SamplingConfig
from smcspec.engine import start_cache


def time_forward(model, context: list[int], batch: int, new_tokens: int, reps: int) -> float:
    """Median seconds of one forward of `new_tokens` tokens per row at `batch` rows, on a cache
    holding `context` (cropped back after each timing, so every rep sees the same context)."""
    cache = start_cache(model, torch.tensor(context), rows=batch)
    model.forward(torch.tensor([context[-1:]] * batch), cache, 1)  # cache now holds the context
    length = cache.length
    tokens = torch.tensor([context[-new_tokens:]] * batch)
    times = []
    for _ in range(reps + 1):
        machine.drain()
        start = time.perf_counter()
        model.forward(tokens, cache, new_tokens)
        machine.drain()
        times.append(time.perf_counter() - start)
        cache.crop(length)
    cache.release()
    return statistics.median(times[1:])  # the first is a warm-up


def measure_costs(
    llm, context: list[int], grid: list[tuple[int, int]], reps: int
) -> dict[str, Any]:
    target_one = time_forward(llm.target, context, 1, 1, reps)
    draft_steps = {
        n: time_forward(llm.draft, context, n, 1, reps) for n in sorted({n for n, _ in grid} | {1})
    }
    verify = {(n, k): time_forward(llm.target, context, n, k + 1, reps) for n, k in grid}
    return {"target_one": target_one, "draft": draft_steps, "verify": verify}


def predict(costs: dict[str, Any], n: int, k: int) -> dict[str, float]:
    t1 = costs["target_one"]
    rho = costs["draft"][1] / t1
    round_seconds = k * costs["draft"][n] + costs["verify"][(n, k)]
    return {
        "rho": rho,
        "memory_bound": (k + 1) / (rho * k + 1),
        "measured_costs": (k + 1) * t1 / round_seconds,
    }


def measured_speedups(speed_file: str | Path, temperature: float) -> dict[tuple[int, int], float]:
    """Median over paired runs of smc tokens/s over ar tokens/s, from a `bench speed` file."""
    records = [r for r in measurements(speed_file) if r["temperature"] == temperature]
    ar = {(r["prompt"], r["rep"]): r["tokens_per_second"] for r in records if r["method"] == "ar"}
    ratios: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if r["method"] == "smc" and (r["prompt"], r["rep"]) in ar:
            key = (r["settings"]["particles"], r["settings"]["draft_tokens"])
            ratios.setdefault(key, []).append(r["tokens_per_second"] / ar[(r["prompt"], r["rep"])])
    return {key: statistics.median(v) for key, v in ratios.items()}


def roofline_table(costs: dict[str, Any], grid: list[tuple[int, int]], measured: dict) -> str:
    lines = [
        f"target one-token step {1000 * costs['target_one']:.0f} ms; draft step at batch 1 "
        f"{1000 * costs['draft'][1]:.0f} ms (rho = {costs['draft'][1] / costs['target_one']:.2f})",
        "",
        "| N | K | draft step at N (ms) | verify N x (K+1) (ms) | predicted S (memory-bound) "
        "| predicted S (measured costs) | measured S |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, k in grid:
        p = predict(costs, n, k)
        m = measured.get((n, k))
        lines.append(
            f"| {n} | {k} | {1000 * costs['draft'][n]:.0f} | {1000 * costs['verify'][(n, k)]:.0f} "
            f"| {p['memory_bound']:.2f} | {p['measured_costs']:.2f} "
            f"| {'-' if m is None else f'{m:.2f}'} |"
        )
    best = max(grid, key=lambda nk: measured.get(nk, predict(costs, *nk)["measured_costs"]))
    basis = "measured" if best in measured else "predicted from measured costs"
    lines += ["", f"Best configuration on this machine ({basis}): N = {best[0]}, K = {best[1]}."]
    return "\n".join(lines) + "\n"


def run_roofline(
    llm,
    grid: list[tuple[int, int]],
    context: list[int],
    out_dir: str | Path,
    reps: int = 3,
    speed_file: str | None = None,
    temperature: float = SamplingConfig.temperature,
    precision: str = "float32",
) -> str:
    costs = measure_costs(llm, context, grid, reps)
    measured = measured_speedups(speed_file, temperature) if speed_file else {}
    text = (
        f"Roofline: {machine.one_line(machine.describe(precision))}; context {len(context)} "
        f"tokens; median of {reps} timings.\n\n" + roofline_table(costs, grid, measured)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.md").write_text(text)
    return text
