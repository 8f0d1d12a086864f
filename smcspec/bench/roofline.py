"""`smcspec bench roofline`: the paper's speed model, fitted to this machine.

Memory-bound model (the paper): a target pass costs the same for any batch, a draft step costs
rho times a target step, so SMC-SD commits K+1 tokens for K draft steps and one target pass:
    S_mem = (K + 1) / (rho K + 1),   rho = t_draft(1) / t_target(1 token).
Measured-cost model: the same round with the costs this machine actually has, including the
compute-bound penalty of wide batches:
    S_meas = (K + 1) t_target(1) / (K t_draft(N) + t_target(N x (K+1))).
sd rows use the same round at N = 1. With speed runs at hand, every row counts the tokens its
rounds actually committed (sd: 1 + accepted drafts; both: the last round cut short by the length
limit) in place of K + 1. "measured / predicted" is how close the implementation comes to its
own round's forward passes: the rest is everything else (sampling, weights, resampling, Python).
Both are set beside the end-to-end speed-up, measured or read from a `bench speed` result file.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from smcspec.bench import machine
from smcspec.bench.report import decode_rate
from smcspec.bench.results import measurements
from smcspec.config import SamplingConfig
from smcspec.engine.timing import time_forward

Row = tuple[str, int, int]  # (method, N, K): ("smc", N, K) or ("sd", 1, K)


def measure_costs(llm, context: list[int], rows: list[Row], reps: int) -> dict[str, Any]:
    target_one = time_forward(llm.target, context, 1, 1, reps)
    sizes = sorted({n for _, n, _ in rows} | {1})
    draft_steps = {n: time_forward(llm.draft, context, n, 1, reps) for n in sizes}
    verify = {
        (n, k): time_forward(llm.target, context, n, k + 1, reps)
        for n, k in dict.fromkeys((n, k) for _, n, k in rows)
    }
    return {"target_one": target_one, "draft": draft_steps, "verify": verify}


def predict(
    costs: dict[str, Any], n: int, k: int, tokens_per_round: float | None = None
) -> dict[str, float]:
    """A round of K draft steps at N rows and one verify pass over N x (K+1) positions commits
    `tokens_per_round` tokens: K+1 for smc, 1 + accepted drafts for sd. Measured, it also counts
    the last round, cut short by the length limit (64 tokens are 7 rounds of 9 and one of 1)."""
    t1 = costs["target_one"]
    rho = costs["draft"][1] / t1
    tokens = k + 1 if tokens_per_round is None else tokens_per_round
    round_seconds = k * costs["draft"][n] + costs["verify"][(n, k)]
    return {
        "rho": rho,
        "tokens_per_round": tokens,
        "memory_bound": tokens / (rho * k + 1),
        "measured_costs": tokens * t1 / round_seconds,
    }


def measured_speedups(speed_file: str | Path, temperature: float) -> dict[Row, dict[str, float]]:
    """Per (method, N, K) of a `bench speed` file: the median over paired runs of decode
    tokens/s over ar's decode tokens/s, and the mean tokens committed per round. Decode leaves
    out the prompt's prefill, which the round model does not price (and which sd and smc pay
    twice: target and draft)."""
    records = [r for r in measurements(speed_file) if r["temperature"] == temperature]
    ar = {(r["prompt"], r["rep"]): decode_rate(r) for r in records if r["method"] == "ar"}
    ratios: dict[Row, list[float]] = {}
    per_round: dict[Row, list[float]] = {}
    for r in records:
        row = _row_of(r)
        if row is None or (r["prompt"], r["rep"]) not in ar:
            continue
        ratios.setdefault(row, []).append(decode_rate(r) / ar[(r["prompt"], r["rep"])])
        per_round.setdefault(row, []).append(r["new_tokens"] / r["rounds"])
    return {
        row: {"speedup": statistics.median(v), "tokens_per_round": statistics.fmean(per_round[row])}
        for row, v in ratios.items()
    }


def _row_of(record: dict[str, Any]) -> Row | None:
    s = record["settings"]
    if set(s) - {"particles", "draft_tokens", "resample_threshold"}:
        return None  # power, a draft temperature: not what the roofline models
    if record["method"] == "smc":
        return ("smc", s["particles"], s["draft_tokens"])
    if record["method"] == "sd":
        return ("sd", 1, s["draft_tokens"])
    return None


def roofline_table(costs: dict[str, Any], rows: list[Row], measured: dict) -> str:
    lines = [
        f"target one-token step {1000 * costs['target_one']:.1f} ms; draft step at batch 1 "
        f"{1000 * costs['draft'][1]:.1f} ms (rho = {costs['draft'][1] / costs['target_one']:.2f})",
        "",
        "| method | N | K | tokens / round | draft step at N (ms) | verify N x (K+1) (ms) "
        "| predicted S (memory-bound) | predicted S (measured costs) | measured S (decode) "
        "| measured / predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(_table_line(costs, row, measured.get(row)))
    smc = [r for r in rows if r[0] == "smc"]
    if smc:
        best = max(smc, key=lambda r: _best_key(costs, r, measured.get(r)))
        basis = "measured" if best in measured else "predicted from measured costs"
        lines += ["", f"Best smc configuration here ({basis}): N = {best[1]}, K = {best[2]}."]
    return "\n".join(lines) + "\n"


def _table_line(costs: dict[str, Any], row: Row, seen: dict | None) -> str:
    method, n, k = row
    per_round = None if seen is None else seen["tokens_per_round"]
    if method == "sd" and per_round is None:
        return f"| sd | 1 | {k} | - | {1000 * costs['draft'][1]:.1f} | - | - | - | - | - |"
    p = predict(costs, n, k, per_round)
    m = None if seen is None else seen["speedup"]
    share = "-" if m is None else f"{m / p['measured_costs']:.0%}"
    return (
        f"| {method} | {n} | {k} | {p['tokens_per_round']:.2f} | {1000 * costs['draft'][n]:.1f} "
        f"| {1000 * costs['verify'][(n, k)]:.1f} | {p['memory_bound']:.2f} "
        f"| {p['measured_costs']:.2f} | {'-' if m is None else f'{m:.2f}'} | {share} |"
    )


def _best_key(costs: dict[str, Any], row: Row, seen: dict | None) -> float:
    return seen["speedup"] if seen else predict(costs, row[1], row[2])["measured_costs"]


def run_roofline(
    llm,
    rows: list[Row],
    context: list[int],
    out_dir: str | Path,
    reps: int = 3,
    speed_file: str | None = None,
    temperature: float = SamplingConfig.temperature,
    precision: str = "float32",
) -> str:
    costs = measure_costs(llm, context, rows, reps)
    measured = measured_speedups(speed_file, temperature) if speed_file else {}
    text = (
        f"Roofline: {machine.one_line(machine.describe(precision))}; context {len(context)} "
        f"tokens; median of {reps} timings.\n\n" + roofline_table(costs, rows, measured)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.md").write_text(text)
    return text
