"""Summaries, Markdown tables and PNG plots from result files."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

Z95 = 1.959963984540054
STAGES = ("prefill", "draft", "verify", "resample", "other")


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (good at small n and p near 0 or 1)."""
    if n <= 0:
        raise ValueError("n must be positive")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def speed_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (label, temperature): median/min/max tokens/s and the method's diagnostics;
    `vs_ar` is the median over paired runs (same prompt, repetition) of tokens/s / ar's tokens/s."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["label"], r["temperature"])].append(r)
    ar_tps = {
        (r["temperature"], r["prompt"], r["rep"]): r["tokens_per_second"]
        for r in records
        if r["label"] == "ar"
    }
    rows = []
    for (label, temp), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        tps = [r["tokens_per_second"] for r in rs]
        ratios = [
            r["tokens_per_second"] / ar_tps[(temp, r["prompt"], r["rep"])]
            for r in rs
            if (temp, r["prompt"], r["rep"]) in ar_tps
        ]
        decode = [decode_rate(r) for r in rs if "prefill" in r.get("time_split", {})]
        row: dict[str, Any] = {
            "label": label,
            "temperature": temp,
            "runs": len(rs),
            "median_tps": statistics.median(tps),
            "median_decode_tps": statistics.median(decode) if decode else None,
            "min_tps": min(tps),
            "max_tps": max(tps),
            "vs_ar": statistics.median(ratios) if ratios else None,
            "acceptance_rate": _mean(
                [r["acceptance_rate"] for r in rs if r.get("acceptance_rate") is not None]
            ),
            "mean_accepted_length": _mean(
                [r["mean_accepted_length"] for r in rs if r.get("mean_accepted_length") is not None]
            ),
            "mean_ess": _mean([e for r in rs for e in r.get("ess", [])]),
            "min_ess": min((e for r in rs for e in r.get("ess", [])), default=None),
            "resample_rate": _resample_rate(rs),
        }
        row.update(_split_fractions(rs))
        rows.append(row)
    return rows


def decode_rate(record: dict[str, Any]) -> float:
    """New tokens per second after the prefill (the whole run's rate when it was not timed)."""
    prefill = record.get("time_split", {}).get("prefill", 0.0)
    return record["new_tokens"] / (record["seconds"] - prefill)


def _order(label: str) -> tuple[int, str]:
    rank = {"ar": 0, "sd": 1, "smc": 2, "hf": 3, "hf-assisted": 4}
    return rank.get(label.split()[0], 9), label


def _resample_rate(rs: list[dict]) -> float | None:
    rounds = sum(r.get("rounds", 0) for r in rs if "resamples" in r)
    return sum(r["resamples"] for r in rs if "resamples" in r) / rounds if rounds else None


def _split_fractions(rs: list[dict]) -> dict[str, float]:
    splits = [r["time_split"] for r in rs if "time_split" in r]
    if not splits:
        return {}
    total = sum(sum(s.values()) for s in splits)
    return {f"frac_{k}": sum(s[k] for s in splits) / total for k in splits[0]}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def speed_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | T | runs | median tok/s | min-max | vs ar | decode tok/s | acceptance "
        "| accepted/round | mean ESS | min ESS | resample rate "
        "| prefill / draft / verify / resample / other |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for r in rows:
        split = "-"
        if "frac_draft" in r:
            split = " / ".join(f"{100 * r.get('frac_' + k, 0):.0f}%" for k in STAGES)
        elif "frac_prefill" in r:  # a peer that times its prefill only
            split = f"prefill {100 * r['frac_prefill']:.0f}%"
        lines.append(
            f"| {r['label']} | {r['temperature']} | {r['runs']} | {_fmt(r['median_tps'])} "
            f"| {_fmt(r['min_tps'])}-{_fmt(r['max_tps'])} | {_fmt(r['vs_ar'])}x "
            f"| {_fmt(r.get('median_decode_tps'))} "
            f"| {_fmt(r['acceptance_rate'])} | {_fmt(r['mean_accepted_length'])} "
            f"| {_fmt(r['mean_ess'])} | {_fmt(r['min_ess'])} | {_fmt(r['resample_rate'])} "
            f"| {split} |"
        )
    return head + "\n".join(lines) + "\n"


def accuracy_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["label"]].append(r)
    rows = []
    for label, rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        passed = sum(bool(r["passed"]) for r in rs)
        low, high = wilson_interval(passed, len(rs))
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        rows.append(
            {
                "label": label,
                "problems": len(rs),
                "passed": passed,
                "pass_at_1": passed / len(rs),
                "ci_low": low,
                "ci_high": high,
                "tokens_per_second": tokens / seconds if seconds else None,
                "mean_target_logp": _mean(
                    [r["mean_target_logp"] for r in rs if r.get("mean_target_logp") is not None]
                ),
            }
        )
    return rows


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| method | problems | pass@1 | 95% CI | tok/s | mean target log-prob / token |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['label']} | {r['problems']} | {r['pass_at_1']:.3f} ({r['passed']}/{r['problems']}) "
        f"| {r['ci_low']:.3f}-{r['ci_high']:.3f} | {_fmt(r['tokens_per_second'])} "
        f"| {_fmt(r['mean_target_logp'], 3)} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in (speed up, accuracy up)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and y2 >= y) and (x2 > x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_temperature(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_label: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        by_label[r["label"]].append((r["temperature"], r["median_tps"]))
    for label, pts in sorted(by_label.items(), key=lambda kv: _order(kv[0])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    _finish(plt, fig, ax, "temperature", "tokens / s (median)", title, path)


def plot_pareto(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["tokens_per_second"] or 0.0 for r in rows]
    ys = [r["pass_at_1"] for r in rows]
    errs = [
        [y - r["ci_low"] for y, r in zip(ys, rows, strict=False)],
        [r["ci_high"] - y for y, r in zip(ys, rows, strict=False)],
    ]
    ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3)
    for x, y, r in zip(xs, ys, rows, strict=False):
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = sorted(pareto_front(list(zip(xs, ys, strict=False))), key=lambda i: xs[i])
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", alpha=0.6, label="Pareto front")
    _finish(plt, fig, ax, "tokens / s", "pass@1 (95% CI)", title, path)


def _finish(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: str | Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 110), fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def header_of(path: str | Path) -> dict[str, Any]:
    from smcspec.bench.results import header

    return header(path)


def speed_caption(hdr: dict[str, Any]) -> str:
    from smcspec.bench.machine import one_line

    plan = hdr.get("plan", {})
    length = "natural stop at EOS" if plan.get("natural_stop") else "EOS ignored"
    where = one_line(hdr["machine"]) if "machine" in hdr else "unknown machine"
    return (
        f"Speed: {where}. {models_line(hdr)}. First {plan.get('prompts')} HumanEval prompts as "
        f"chat messages, up to {plan.get('max_new_tokens')} new tokens ({length}), batch of one "
        f"request, {plan.get('reps')} repetition(s), base seed {plan.get('seed')}."
    )


def models_line(hdr: dict[str, Any]) -> str:
    models = hdr.get("models", {})
    return f"target {models.get('target', '?')}, draft {models.get('draft', '?')}"
