"""Summaries, Markdown tables and PNG plots from result files."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from smcspec.bench.contenders import OURS
from smcspec.engine import method_names, method_row, setting_label

Z95 = 1.959963984540054
STAGES = ("prefill", "draft", "verify", "resample", "other")
# methods whose diagnostics count accepted and proposed drafts without a rate
COUNTED = ("msd", "msd-block", "msd-lookup-draft", "auto", "auto-approx")
PROMPT_SET_NAMES = {
    "humaneval": "HumanEval",
    "gsm8k": "GSM8K",
    "mt-bench": "MT-Bench",
    "copy-edit": "copy-edit",
}


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (good at small n and p near 0 or 1)."""
    if n <= 0:
        raise ValueError("n must be positive")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 (or n) successes the bound is exactly 0 (1); rounding can leave it a hair inside
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def speed_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (label, temperature): median/min/max tokens/s and the method's diagnostics;
    `vs_ar` is the median over paired runs (same prompt, repetition) of tokens/s / ar's tokens/s.
    msd and auto's acceptance is their accepted / proposed drafts; auto's `chose` its settings'
    shares of its rounds."""
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
            "acceptance_rate": _acceptance(rs),
            "mean_accepted_length": _mean(
                [r["mean_accepted_length"] for r in rs if r.get("mean_accepted_length") is not None]
            ),
            "mean_ess": _mean([e for r in rs for e in r.get("ess", [])]),
            "min_ess": min((e for r in rs for e in r.get("ess", [])), default=None),
            "resample_rate": _resample_rate(rs),
        }
        row.update(_split_fractions(rs))
        row.update(_identity(rs[0]), chose=chose([seg for r in rs for seg in r.get("chosen", ())]))
        rows.append(row)
    return rows


def _acceptance(rs: list[dict]) -> float | None:
    """sd's mean acceptance rate; msd's and auto's (which report counts, not a rate) their
    accepted / proposed drafts over all runs."""
    rates = [r["acceptance_rate"] for r in rs if r.get("acceptance_rate") is not None]
    if rates or rs[0].get("method") not in COUNTED:
        return _mean(rates)
    return pooled_acceptance(rs)


def _identity(r: dict) -> dict[str, Any]:
    """The method and draft temperature of a row, for the per-cell summary."""
    settings = r.get("settings", {})
    return {"method": r.get("method"), "draft_temperature": settings.get("draft_temperature")}


def chose(segments: list[dict[str, Any]]) -> str | None:
    """auto's chosen settings (`AutoStats.settings`' entries, over any number of runs) by their
    share of its rounds, most first, e.g. "sd K=4 (90%), msd N=2 K=3 (10%)"; None without any."""
    rounds: dict[str, int] = defaultdict(int)
    for seg in segments:
        rounds[setting_label(seg)] += seg["rounds"]
    total = sum(rounds.values())
    if not total:
        return None
    ranked = sorted(rounds.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{label} ({100 * n / total:.0f}%)" for label, n in ranked)


def pooled_acceptance(diagnostics: list[dict[str, Any]]) -> float | None:
    """accepted / proposed drafts over runs that count them (msd, auto); None without any."""
    proposed = sum(d.get("proposed_tokens", 0) for d in diagnostics)
    return sum(d.get("accepted_tokens", 0) for d in diagnostics) / proposed if proposed else None


def decode_rate(record: dict[str, Any]) -> float:
    """New tokens per second after the prefill (the whole run's rate when it was not timed)."""
    prefill = record.get("time_split", {}).get("prefill", 0.0)
    return record["new_tokens"] / (record["seconds"] - prefill)


def _order(label: str) -> tuple[int, str]:
    rank = {"ar": 0, "sd": 1, "smc": 2, "msd": 3, "auto": 4, "hf": 5, "hf-assisted": 6}
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
    # auto's choices in a last column, only where auto ran: other tables stay as they were
    chose = any(r.get("chose") for r in rows)
    if chose:
        head = head.replace(" |\n|", " | auto chose (share of rounds) |\n|").replace(
            "--- |\n", "--- | --- |\n"
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
            f"| {split} |" + (f" {_fmt(r.get('chose'))} |" if chose else "")
        )
    return head + "\n".join(lines) + "\n"


# the fixed settings auto chooses among (the table's rows that are one setting): exact ones,
# and the approximate ones (smc) too with approximate
FIXED = tuple(m for m in method_names() if not method_row(m).chooses)
EXACT = tuple(m for m in FIXED if method_row(m).exact)


def best_fixed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (temperature, draft temperature): the fastest fixed exact setting (ar, sd, msd)
    and the fastest of all four methods (smc too; Power targets aside), by median tokens/s, and
    auto's and auto approx's ratios to them and to ar (ar, which drafts nothing, counts in every
    draft temperature's cell). Also sd's acceptance at its best K and msd's best over sd's."""
    cells = dict.fromkeys(
        (r["temperature"], r.get("draft_temperature")) for r in rows if r.get("method") != "ar"
    )
    out = []
    for temp, draft_t in cells:
        here = [
            r
            for r in rows
            if r["temperature"] == temp
            and (r.get("method") == "ar" or r.get("draft_temperature") == draft_t)
        ]
        fixed = [r for r in here if _runs_as(r) in FIXED and "power=" not in r["label"]]
        exact = [r for r in fixed if _runs_as(r) in EXACT]
        best_exact, best_all = _fastest(exact), _fastest(fixed)
        ar, sd, msd = (
            _fastest([r for r in here if r.get("method") == m]) for m in ("ar", "sd", "msd")
        )
        auto, approx = (
            _fastest([r for r in here if r.get("method") == m]) for m in ("auto", "auto-approx")
        )
        out.append(
            {
                "temperature": temp,
                "draft_temperature": draft_t,
                "best_exact": best_exact,
                "best_fixed": best_all,
                "auto_vs_best_exact": _ratio(auto, best_exact),
                "auto_vs_ar": _ratio(auto, ar),
                "approx_vs_best_fixed": _ratio(approx, best_all),
                "sd_acceptance": sd["acceptance_rate"] if sd else None,
                "msd_vs_sd": _ratio(msd, sd),
            }
        )
    return out


def _runs_as(row: dict[str, Any]) -> str | None:
    """The method a row's setting runs as: sd's and msd's variants (block rule, lookup drafts)
    are sd and msd settings, fixed and exact like them."""
    return OURS.get(row.get("method"), row.get("method"))


def _fastest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(rows, key=lambda r: r["median_tps"], default=None)


def _ratio(row: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    return row["median_tps"] / base["median_tps"] if row and base else None


def best_fixed_table(cells: list[dict[str, Any]]) -> str:
    """`best_fixed` as Markdown; ratios are of median tokens/s. The targets: auto >= 0.95x the
    best exact and >= 0.95x ar in every cell; auto approx >= 0.95x the best of all; msd's best
    >= sd's where sd's acceptance is <= 0.8."""
    head = (
        "| T | draft T | best fixed exact | tok/s | auto / best exact | auto / ar "
        "| best fixed | tok/s | auto approx / best fixed | sd acceptance | msd best / sd best |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for c in cells:
        exact, best = c["best_exact"] or {}, c["best_fixed"] or {}
        draft_t = "target's" if c["draft_temperature"] is None else f"{c['draft_temperature']:g}"
        lines.append(
            f"| {c['temperature']} | {draft_t} | {exact.get('label', '-')} "
            f"| {_fmt(exact.get('median_tps'))} | {_times(c['auto_vs_best_exact'])} "
            f"| {_times(c['auto_vs_ar'])} | {best.get('label', '-')} "
            f"| {_fmt(best.get('median_tps'))} | {_times(c['approx_vs_best_fixed'])} "
            f"| {_fmt(c['sd_acceptance'])} | {_times(c['msd_vs_sd'])} |"
        )
    return head + "\n".join(lines) + "\n"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided p-value of McNemar's exact test on paired outcomes: b problems one method
    solved and the other did not, c the other way round. Under no difference the b + c
    discordant pairs split as Binomial(b + c, 1/2); p is twice the smaller tail, at most 1."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def accuracy_summary(records: list[dict[str, Any]], base: str = "ar") -> list[dict[str, Any]]:
    """One row per label: pass@1 with its Wilson interval, tokens/s, the mean target log-prob;
    against `base` (when it ran) on the problems both ran: the difference in pass@1 and
    McNemar's exact p; and whether the row is on the speed-accuracy Pareto front."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["label"]].append(r)
    base_passed = {r["task_id"]: bool(r["passed"]) for r in groups.get(base, []) if "task_id" in r}
    rows = []
    for label, rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        passed = sum(bool(r["passed"]) for r in rs)
        low, high = wilson_interval(passed, len(rs))
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        row = {
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
        pairs = [
            (base_passed[r["task_id"]], bool(r["passed"]))
            for r in rs
            if label != base and r.get("task_id") in base_passed
        ]
        rows.append(row | _paired(pairs) if pairs else row)
    points = [(r["tokens_per_second"] or 0.0, r["pass_at_1"]) for r in rows]
    front = set(pareto_front(points))
    return [r | {"frontier": i in front} for i, r in enumerate(rows)]


def _paired(pairs: list[tuple[bool, bool]]) -> dict[str, Any]:
    """(base passed, this passed) per shared problem -> the paired comparison's figures."""
    only_base = sum(1 for b, t in pairs if b and not t)
    only_this = sum(1 for b, t in pairs if t and not b)
    return {
        "paired": len(pairs),
        "only_base": only_base,
        "only_this": only_this,
        "delta": (only_this - only_base) / len(pairs),
        "mcnemar_p": mcnemar_exact(only_base, only_this),
    }


def accuracy_table(rows: list[dict[str, Any]], base: str = "ar") -> str:
    head = (
        f"| method | problems | pass@1 | 95% CI | vs {base} (paired: lost/won, McNemar p) "
        "| tok/s | Pareto front | mean target log-prob / token |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['label']} | {r['problems']} | {r['pass_at_1']:.3f} ({r['passed']}/{r['problems']}) "
        f"| {r['ci_low']:.3f}-{r['ci_high']:.3f} | {_versus(r)} "
        f"| {_fmt(r['tokens_per_second'])} | {'yes' if r.get('frontier') else '-'} "
        f"| {_fmt(r['mean_target_logp'], 3)} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def _versus(row: dict[str, Any]) -> str:
    if "paired" not in row:
        return "-"
    return (
        f"{row['delta']:+.3f} on {row['paired']} ({row['only_base']}/{row['only_this']}, "
        f"p = {row['mcnemar_p']:.2g})"
    )


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


def speed_caption(hdr: dict[str, Any], machines: list[dict[str, Any]]) -> str:
    """The speed table's caption; `machines`: the ones its records ran on (`results.machines`)."""
    from smcspec.bench.machine import ran_on

    plan = hdr.get("plan", {})
    length = "natural stop at EOS" if plan.get("natural_stop") else "EOS ignored"
    where = ran_on(machines)
    return (
        f"Speed: {where}. {models_line(hdr)}. First {plan.get('prompts')} "
        f"{PROMPT_SET_NAMES[plan.get('prompt_set', 'humaneval')]} prompts as "
        f"chat messages, up to {plan.get('max_new_tokens')} new tokens ({length}), batch of one "
        f"request, {plan.get('reps')} repetition(s), base seed {plan.get('seed')}."
        + (f" {hdr['auto_costs']}." if "auto_costs" in hdr else "")
    )


def models_line(hdr: dict[str, Any]) -> str:
    models = hdr.get("models", {})
    return f"target {models.get('target', '?')}, draft {models.get('draft', '?')}"
