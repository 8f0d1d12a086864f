"""An estimate of smcspec's speed on one H200: the GPU engine's old design against the new one,
written as benchmarks/gpu/estimate.md.

Nothing here ran on a GPU and nothing here is measured: the costs are `gpu.costs`'s counted
bytes, FLOPs and kernel launches priced with `gpu.assumptions`. This module holds the issue's
targets and writes the report; every row of it is labelled ESTIMATE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from smcspec.bench.gpu.assumptions import SLOW_END, SOURCES, Assumptions, slow_end
from smcspec.bench.gpu.costs import (
    GIVEN_FIXED_LAUNCHES,
    METHODS,
    WAITS_SOURCE,
    Design,
    Launches,
    Method,
    ModelShape,
    Pair,
    attention_bytes,
    attention_s,
    floor_s,
    new_design,
    old_design,
    pass_cost,
    per_layer_launches,
    sample_s,
    speed,
    split_launch,
    weight_bytes,
)
from smcspec.bench.gpu.pairs import PAIRS
from smcspec.bench.results import measurements

__all__ = [  # the cost model's names callers import from here
    "GIVEN_FIXED_LAUNCHES",
    "METHODS",
    "SLOW_END",
    "SOURCES",
    "Assumptions",
    "Design",
    "Launches",
    "ModelShape",
    "Pair",
    "attention_bytes",
    "attention_s",
    "floor_s",
    "new_design",
    "old_design",
    "pass_cost",
    "per_layer_launches",
    "report",
    "sample_s",
    "slow_end",
    "speed",
    "split_launch",
    "weight_bytes",
]

DESIGN_CONTEXT = 512  # the GPU bench's context (GpuPlan.context)
ATTENTION_CONTEXTS = (512, 2048, 4096)
ESTIMATE_PAIR = "qwen2.5-7b+coder-0.5b"  # the pair the targets are set for
ACCEPTANCE_FILE = Path("benchmarks/cpu/engine-int8/engine.jsonl")


def measured_acceptance(path: str | Path, label: str = "sd K=4") -> float:
    """Pooled per-token acceptance of the native engine's `label` runs in a `bench engine`
    result file: accepted drafts / drafts checked, over every prompt."""
    runs = [r for r in measurements(path) if r.get("label") == label]
    runs = [r for r in runs if r.get("backend") == "native"]
    if not runs:
        raise ValueError(f"{path}: no native {label!r} runs to read an acceptance from")
    return sum(r["accepted_tokens"] for r in runs) / sum(r["proposed_tokens"] for r in runs)


# ---- the targets --------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    what: str
    goal: str
    measure: Callable[[Pair, Design, Assumptions, float], tuple[float, str]]  # (value, shown)
    limit: float
    at_most: bool  # value <= limit (else value >= limit)
    strict: bool = False

    def met(self, value: float) -> bool:
        if self.strict:
            return value < self.limit if self.at_most else value > self.limit
        return value <= self.limit if self.at_most else value >= self.limit


def _step_over_floor(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
    step = pass_cost(pair.target, 1, 1, DESIGN_CONTEXT, d, a).total_s
    ratio = step / floor_s(pair.target, a)
    return ratio, f"{1e3 * step:.2f} ms = {ratio:.2f}x"


def _verify_over_step(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
    verify = pass_cost(pair.target, 8, 9, 2048, d, a).total_s
    ratio = verify / pass_cost(pair.target, 1, 1, 2048, d, a).total_s
    return ratio, f"{1e3 * verify:.2f} ms = {ratio:.2f}x"


def _attention_share(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
    cost = pass_cost(pair.target, 1, 1, 4096, d, a)
    share = cost.attention_s / cost.total_s
    return share, f"{1e3 * cost.attention_s:.2f} of {1e3 * cost.total_s:.2f} ms = {share:.0%}"


def _draft_step(rows: int) -> Callable[[Pair, Design, Assumptions, float], tuple[float, str]]:
    def measure(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
        ms = 1e3 * pass_cost(pair.draft, rows, 1, DESIGN_CONTEXT, d, a).total_s
        return ms, f"{ms:.2f} ms"

    return measure


def _speedup(method: Method) -> Callable[[Pair, Design, Assumptions, float], tuple[float, str]]:
    def measure(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
        s = speed(pair, method, d, a, alpha, DESIGN_CONTEXT)
        return s.speedup, f"{s.tokens_per_s:.0f} tok/s = {s.speedup:.2f}x"

    return measure


def _waits(pair: Pair, d: Design, a: Assumptions, alpha: float) -> tuple[float, str]:
    waits = max(d.waits["sd"], d.waits["smc"])
    return waits, f"sd {d.waits['sd']}, smc {d.waits['smc']}"


TARGETS = (
    Target(
        "target one-token step at L=512 / its weight floor", "<= 1.3x", _step_over_floor, 1.3, True
    ),
    Target(
        "verify 8 x 9 = 72 rows at L=2048 / one-token step at L=2048",
        "<= 1.3x",
        _verify_over_step,
        1.3,
        True,
    ),
    Target(
        "attention's share of a one-token step at L=4096",
        "< 15%",
        _attention_share,
        0.15,
        True,
        strict=True,
    ),
    Target("draft step, batch 1, L=512", "<= 1 ms", _draft_step(1), 1.0, True),
    Target("draft step, batch 8, L=512", "<= 1 ms", _draft_step(8), 1.0, True),
    Target("smc N=8 K=8 over ar, L=512", ">= 2.5x", _speedup(("smc", 8, 8)), 2.5, False),
    Target("sd K=4 over ar, L=512", ">= 2x", _speedup(("sd", 1, 4)), 2.0, False),
    Target("host waits per sd / smc round", "<= 1", _waits, 1.0, True),
)


# ---- the report -----------------------------------------------------------------------------


def report(designs: tuple[Design, Design], a: Assumptions, alpha: float, alpha_source: str) -> str:
    """The Markdown of benchmarks/gpu/estimate.md: targets, end to end, attention, passes,
    then every input and constant with its source."""
    pairs = [Pair.load(name) for name in PAIRS]
    target_pair = next(p for p in pairs if p.name == ESTIMATE_PAIR)
    pairs.sort(key=lambda p: p is not target_pair)  # the pair the targets are for first
    sections = [
        "# H200 estimate: the old GPU design against the new (ESTIMATE: nothing here is measured)",
        "",
        "Written by `scripts/gpu_estimate` (`smcspec/bench/gpu/estimate.py`). Every number is "
        "counted bytes, FLOPs and kernel launches of the shipped configs (bf16, random weights "
        "do not change them) priced with the constants at the end; no GPU ran. Realistic error: "
        "+-50%. A pass = max(weight bytes / (HBM x GEMM efficiency), FLOPs / bf16 rate) + "
        "launches x per-kernel cost + attention; rounds use `roofline.predict`.",
        "",
        *_targets_table(pairs, designs, a, alpha),
        "",
        *_speed_table(pairs, designs, a, alpha),
        "",
        *_attention_table(target_pair.target, designs, a),
        "",
        *_pass_table(pairs, designs, a),
        "",
        *_inputs(designs, alpha, alpha_source),
        "",
        *_constants_table(a),
    ]
    return "\n".join(sections) + "\n"


def _targets_table(
    pairs: list[Pair], designs: tuple[Design, Design], a: Assumptions, alpha: float
) -> list[str]:
    lines = [
        "## The issue's targets (set for the first pair; the second is the default CPU pair)",
        "",
        "| label | pair | quantity | target | "
        + " | ".join(f"{d.name} design | {d.name} meets" for d in designs)
        + f" | {designs[-1].name}, slow end | meets |",
        "|---|---|---|---|" + "---|---|" * (len(designs) + 1),
    ]
    columns = [(d, a) for d in designs] + [(designs[-1], slow_end(a))]
    for pair in pairs:
        for target in TARGETS:
            cells = [pair.name, target.what, target.goal]
            for d, assumed in columns:
                value, shown = target.measure(pair, d, assumed, alpha)
                cells += [shown, "yes" if target.met(value) else "**no**"]
            lines.append("| ESTIMATE | " + " | ".join(cells) + " |")
    return [*lines, "", _step_budget(pairs[0], designs[-1], a)]


def _step_budget(pair: Pair, design: Design, a: Assumptions) -> str:
    """What the first target leaves the kernels' fixed costs, in the given design."""
    cost = pass_cost(pair.target, 1, 1, DESIGN_CONTEXT, design, a)
    budget = 1.3 * floor_s(pair.target, a) - cost.weights_s - cost.attention_s
    kernels = max(0, int(budget / a.kernel_s))
    return (
        f"Slow end: {', '.join(f'{k} = {v:g}' for k, v in SLOW_END.items())}. "
        f"At 1.3x its floor, {pair.target.name}'s one-token step ({design.name} design) leaves "
        f"{1e3 * max(budget, 0):.2f} ms for the kernels' fixed costs after its weights and "
        f"attention: {kernels} kernels at {1e6 * a.kernel_s:g} us "
        f"({kernels / pair.target.layers:.1f} a layer), against {cost.launches} counted."
    )


def _speed_table(
    pairs: list[Pair], designs: tuple[Design, Design], a: Assumptions, alpha: float
) -> list[str]:
    lines = [
        f"## End to end, decode at L={DESIGN_CONTEXT} (sd: acceptance {alpha:.3f}; smc: K+1 "
        "tokens a round)",
        "",
        "| label | pair | method | tokens / round | "
        + " | ".join(f"{d.name} round ms | {d.name} tok/s | {d.name} x ar" for d in designs)
        + " |",
        "|---|---|---|---|" + "---|---|---|" * len(designs),
    ]
    for pair in pairs:
        for method in METHODS:
            cells, tokens = [], 1.0
            for d in designs:
                s = speed(pair, method, d, a, alpha, DESIGN_CONTEXT)
                tokens = s.tokens_per_round
                cells += [f"{1e3 * s.round_s:.2f}", f"{s.tokens_per_s:.0f}", f"{s.speedup:.2f}"]
            label = _method_label(method)
            lines.append(
                f"| ESTIMATE | {pair.name} | {label} | {tokens:.2f} | " + " | ".join(cells) + " |"
            )
    return lines


def _method_label(method: Method) -> str:
    name, n, k = method
    return {"ar": "ar", "sd": f"sd K={k}"}.get(name, f"smc N={n} K={k}")


def _attention_table(
    shape: ModelShape, designs: tuple[Design, Design], a: Assumptions
) -> list[str]:
    lines = [
        f"## Attention of {shape.name}, all {shape.layers} layers (old: bytes requested, each "
        f"KV byte GROUP = {shape.group} x t times; new: each KV byte once per (sequence, kv head))",
        "",
        "| label | pass | L | "
        + " | ".join(f"{d.name} MB | {d.name} ms | {d.name} share of pass" for d in designs)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(designs),
    ]
    for rows, t, what in ((1, 1, "decode token"), (8, 9, "verify 8 x (8+1)")):
        for context in ATTENTION_CONTEXTS:
            cells = []
            for d in designs:
                cost = pass_cost(shape, rows, t, context, d, a)
                mb = attention_bytes(shape, rows, t, context, d.split_kv) / 1e6
                share = cost.attention_s / cost.total_s
                cells += [f"{mb:.0f}", f"{1e3 * cost.attention_s:.2f}", f"{share:.0%}"]
            lines.append(f"| ESTIMATE | {what} | {context} | " + " | ".join(cells) + " |")
    return lines


def _pass_table(pairs: list[Pair], designs: tuple[Design, Design], a: Assumptions) -> list[str]:
    lines = [
        f"## Forward passes at L={DESIGN_CONTEXT} (graph replays, no sampling)",
        "",
        "| label | model | rows x t | weight floor ms | weights ms | "
        + " | ".join(
            f"{d.name} launches | {d.name} attention ms | {d.name} pass ms" for d in designs
        )
        + " |",
        "|---|---|---|---|---|" + "---|---|---|" * len(designs),
    ]
    shapes = {p.target.name: (p.target, ((1, 1), (1, 5), (8, 9))) for p in pairs}
    shapes |= {p.draft.name: (p.draft, ((1, 1), (8, 1))) for p in pairs}
    for shape, passes in shapes.values():
        for rows, t in passes:
            costs = [pass_cost(shape, rows, t, DESIGN_CONTEXT, d, a) for d in designs]
            cells = [
                f"{c.launches} | {1e3 * c.attention_s:.2f} | {1e3 * c.total_s:.2f}" for c in costs
            ]
            lines.append(
                f"| ESTIMATE | {shape.name} | {rows} x {t} | {1e3 * floor_s(shape, a):.2f} "
                f"| {1e3 * costs[0].weights_s:.2f} | " + " | ".join(cells) + " |"
            )
    return lines


def _inputs(designs: tuple[Design, Design], alpha: float, alpha_source: str) -> list[str]:
    lines = ["## Inputs", "", f"- sd acceptance {alpha:.3f}: {alpha_source}."]
    for d in designs:
        attention = (
            "split-KV, one program per (sequence, kv head, split), GROUP x t queries in one tile"
            if d.split_kv
            else "one program per (query token, query head)"
        )
        sampler = "two-level (chunked)" if d.chunked_sampling else "one float64 scan a row"
        lines.append(
            f"- {d.name} design: attention {attention}; launches: {d.launches_source}; "
            f"host waits per round: {d.waits} ({WAITS_SOURCE}); sampler {sampler}."
        )
    lines.append(
        "- Not priced: prefill, resampling, the smc first draft step's extra token, the "
        "graphs' bucket padding rows, penalties' host copies."
    )
    return lines


def _constants_table(a: Assumptions) -> list[str]:
    lines = ["## Constants", "", "| name | value | source |", "|---|---|---|"]
    for f in fields(a):
        lines.append(f"| {f.name} | {getattr(a, f.name):g} | {SOURCES[f.name]} |")
    return lines
