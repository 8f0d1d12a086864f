"""An estimate of smcspec's speed on one H200: the GPU engine's old design against the new one.

Nothing here ran on a GPU and nothing here is measured. Every number is bytes, FLOPs and kernel
launches counted from the shipped model configs (`gpu_pairs`), priced with the named constants
of `Assumptions` (each printed with its source), and combined into rounds with the roofline's
own formula (`roofline.predict`). Every row of the output is labelled ESTIMATE.

A forward pass of `rows` sequences, `t` new tokens each, over `context` cached keys:

    t_pass = max(W / (B_hbm e_gemm), 2 P rows t / F_bf16)    weights (memory- or compute-bound)
           + n_launch t_kernel                                each kernel's fixed cost in a graph
           + layers t_attention(rows, t, context)

W is the bf16 bytes of every linear layer and the LM head, P their parameters. The floor of a
one-token step is W / B_hbm: a read-only weight stream, not half a copy's bandwidth.

Attention, per layer, is the slower of its memory traffic and its serial loop:
- old (one program per (query token, query head)): each program walks all its keys, so every
  KV byte is requested GROUP x t times; the re-reads hit L2;
- new (one program per (sequence, kv head, KV split), the GROUP x t queries packed into one
  tile): each KV byte is read once from HBM, and the keys are split so one wave fills the SMs.

A round commits `tokens` for K draft steps at N rows and one verify of N x (K+1) tokens, plus a
sampling call per step and the host waits the design makes; ar is one step, one sampling call
and one host wait per token (`round_costs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from smcspec.bench.gpu import sd_tokens_per_round
from smcspec.bench.gpu_pairs import PAIRS, load_config
from smcspec.bench.results import measurements
from smcspec.bench.roofline import predict

BF16_BYTES = 2
DESIGN_CONTEXT = 512  # the GPU bench's context (GpuPlan.context)
ATTENTION_CONTEXTS = (512, 2048, 4096)
ESTIMATE_PAIR = "qwen2.5-7b+coder-0.5b"  # the pair the targets are set for
ACCEPTANCE_FILE = Path("benchmarks/cpu/engine-int8/engine.jsonl")


@dataclass(frozen=True)
class Assumptions:
    """The H200's figures and the costs nothing here measures (seconds, bytes, counts)."""

    hbm_bytes_per_s: float = 4.3e12
    l2_bytes_per_s: float = 8.0e12
    bf16_flops: float = 7.8e14
    sms: int = 132
    ctas_per_sm: int = 9
    gemm_efficiency: float = 0.875
    kernel_s: float = 2.5e-6
    old_iteration_s: float = 1.7e-6
    new_iteration_s: float = 1.0e-6
    flat_sample_launches: int = 34
    chunked_sample_launches: int = 49
    scan_one_row_s: float = 1.0e-5
    scan_rows_s: float = 1.5e-4
    chunked_scan_s: float = 2.0e-5
    logit_passes: int = 15
    host_wait_s: float = 3.0e-4

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)!r}")
        if self.gemm_efficiency > 1:
            raise ValueError(f"gemm_efficiency must be at most 1, got {self.gemm_efficiency}")


# The slow end of each range the sources give (ASSUMED values: twice the value), for the
# targets table's pessimistic column; the rest stay as they are.
SLOW_END = {
    "gemm_efficiency": 0.85,
    "kernel_s": 3.0e-6,
    "new_iteration_s": 2.0e-6,
    "scan_one_row_s": 2.0e-5,
    "scan_rows_s": 2.0e-4,
    "chunked_scan_s": 4.0e-5,
    "host_wait_s": 6.0e-4,
}


def slow_end(a: Assumptions) -> Assumptions:
    return replace(a, **SLOW_END)


PREFLIGHT = "the GPU pre-flight review of the CUDA path"
SOURCES = {
    "hbm_bytes_per_s": "HBM read bandwidth: a device-to-device copy moved 4.3 TB/s counting "
    "bytes read and written on an H200 of this project's device pool (its notes, 2026-10-28 "
    "and 11-04); a read-only stream runs at about the same (datasheet 4.8 TB/s)",
    "l2_bytes_per_s": f"L2 bandwidth the old kernel's re-reads are served at ({PREFLIGHT})",
    "bf16_flops": "dense bf16 matrix rate: 769-798 TFLOP/s measured on random data on an "
    "H200 of the device pool (its notes); only binds for wide verifies",
    "sms": "multiprocessors of the H200 (PyTorch's report on the device)",
    "ctas_per_sm": f"programs resident per SM: 56 registers x 128 threads ({PREFLIGHT}, the "
    "sm_90 compile of the old kernel); the new kernel's few hundred programs fit one wave at "
    "any occupancy >= 2",
    "gemm_efficiency": f"share of HBM bandwidth cuBLAS reaches streaming bf16 weights at <= 150 "
    f"rows: 85-90% ({PREFLIGHT})",
    "kernel_s": f"fixed cost of one kernel inside a CUDA graph (gap, fill and drain): 2-3 us "
    f"({PREFLIGHT}, finding 2); charged to every kernel, weight-streaming ones too",
    "old_iteration_s": f"one key block of the old kernel: three dependent global loads and ~6 "
    f"barriers, no pipelining, read off its sm_90 SASS ({PREFLIGHT}, finding 1)",
    "new_iteration_s": "one key block of the new split-KV kernel: one pipelined round trip "
    "(num_stages) and two tl.dot; ASSUMED, to be measured with do_bench on the device",
    "flat_sample_launches": "kernel-launching ops of one sampling call (law + sample, one "
    "float64 scan of the row) on the CUDA branch: 40 aten ops, 6 of them views, counted on the "
    "meta device at commit b5936c1",
    "chunked_sample_launches": "the same for the two-level sampler (law + sample_at, chunks of "
    "~sqrt(V)): counted on the meta device at commit a6a70a8 (views and allocations not "
    "counted, as launches.count_ops)",
    "scan_one_row_s": "float64 CDF scan of one row of 152k logits (CUB's device scan): ASSUMED",
    "scan_rows_s": f"float64 CDF scan at >= 2 rows, one 512-thread block a row: 0.1-0.2 ms "
    f"({PREFLIGHT}, finding 6)",
    "chunked_scan_s": "the two-level sampler's scans (a chunk sum and scan over ~390 chunks, "
    "then one chunk of ~390 tokens): ASSUMED a few us each",
    "logit_passes": f"elementwise passes over the float32 logits per sampling call (temper, "
    f"log_softmax, nan_to_num, ...): about 15 ({PREFLIGHT}, finding 14)",
    "host_wait_s": f"GPU idle per host wait (blocking copy, then the host loads and launches the "
    f"next graph): 0.3-0.6 ms, low end taken ({PREFLIGHT}, finding 5)",
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one shipped config (`gpu_pairs.load_config`) that the costs depend on."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def load(cls, name: str, vocab: int | None = None) -> ModelShape:
        """`vocab` pads a draft's vocabulary to its target's, as `gpu_pairs.build_pair` does."""
        cfg = load_config(name)
        heads = cfg["num_attention_heads"]
        return cls(
            name=name,
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab=vocab or cfg["vocab_size"],
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def block_n(self) -> int:
        """Keys per loop step, as `paged_attention.plan` picks them (the old kernel took the
        same for head_dim 64 and 128)."""
        return 64 if self.head_dim <= 64 else 32


Launches = Callable[[ModelShape, int, int], int]  # (model, rows, t) -> kernels of one pass


@dataclass(frozen=True)
class Design:
    name: str
    split_kv: bool  # new attention: once per (sequence, kv head, split), queries packed
    launches: Launches
    launches_source: str
    waits: dict[str, int]  # method -> host waits per round (ar: per token)
    chunked_sampling: bool  # two-level CDF inversion (else one float64 scan of the row)


GIVEN_FIXED_LAUNCHES = 6  # embedding, RoPE lookups, final norm, head: count_ops' fused path


def per_layer_launches(per_layer: int, fixed: int) -> Launches:
    return lambda shape, rows, t: per_layer * shape.layers + fixed


# Host waits per round without logprobs, counted on the meta device before and after commit
# a6a70a8 (its message): blocking copies of the drafts, sd's accept tests read one by one.
WAITS_SOURCE = "counted on the meta device before and after commit a6a70a8, without logprobs"
OLD_WAITS = {"ar": 1, "sd": 4, "smc": 3}
NEW_WAITS = {"ar": 1, "sd": 1, "smc": 1}


def old_design(launches: Launches, launches_source: str) -> Design:
    """The engine before issue 26: per-(token, head) attention, the plain torch layer, blocking
    host copies inside a round, one float64 scan of the vocabulary per draw."""
    return Design("old", False, launches, launches_source, OLD_WAITS, chunked_sampling=False)


def new_design(launches: Launches, launches_source: str) -> Design:
    """Split-KV attention (its merges added by `pass_cost`), the fused layer, one host wait a
    round (asynchronous copies from pinned memory, one packed read back), the two-level
    sampler."""
    return Design("new", True, launches, launches_source, NEW_WAITS, chunked_sampling=True)


# ---- one forward pass -----------------------------------------------------------------------


def weight_params(shape: ModelShape) -> int:
    """Parameters a pass streams: every linear layer and the LM head (tied or not, every step
    reads all of it); the embedding is gathered a row at a time and norms are negligible."""
    s = shape
    attention = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)
    mlp = 3 * s.hidden * s.intermediate
    return s.layers * (attention + mlp) + s.vocab * s.hidden


def weight_bytes(shape: ModelShape) -> int:
    return weight_params(shape) * BF16_BYTES


def floor_s(shape: ModelShape, a: Assumptions) -> float:
    """No one-token step can beat reading its weights once at HBM read bandwidth."""
    return weight_bytes(shape) / a.hbm_bytes_per_s


def keys_seen(context: int, t: int) -> int:
    """Keys the t new tokens of a sequence attend to, summed: token i (0-based) sees the
    `context` cached keys, the i earlier new ones and its own."""
    return t * context + t * (t + 1) // 2


def kv_bytes_per_key(shape: ModelShape) -> int:
    return 2 * shape.head_dim * BF16_BYTES  # K and V of one kv head


def attention_bytes(shape: ModelShape, rows: int, t: int, context: int, split_kv: bool) -> int:
    """KV bytes one pass requests, all layers. Old: every (query token, query head) program
    walks its own keys. New: each (sequence, kv head) reads its context + t keys once."""
    reads = shape.kv_heads * (context + t) if split_kv else shape.heads * keys_seen(context, t)
    return shape.layers * rows * reads * kv_bytes_per_key(shape)


MAX_SPLITS = 16  # paged_attention.plan: at most 16 splits ...
SPLIT_FILL = 2  # ... chosen so programs reach about twice the SMs


@dataclass(frozen=True)
class SplitLaunch:
    """The new kernel's launch as `paged_attention.plan` picks it from the shapes."""

    block_q: int  # query tokens of one sequence per program
    programs: int  # programs with work (the grid's spare q-block rows exit at once)
    splits: int  # S, programs sharing one q-block's keys

    @property
    def merges(self) -> bool:
        return self.splits > 1


def split_launch(shape: ModelShape, rows: int, t: int, context: int, a: Assumptions) -> SplitLaunch:
    """Tile rows M = block_q x GROUP: 16 for a decode step, 64 for a verify; S from the grid's
    q-block rows (rows x t // block_q + rows), capped by the key tiles of `context` + t (the
    graphs' static table is wider, so this cap only binds at short contexts)."""
    block_m = max(16 if t * shape.group <= 16 else 64, 1 << (shape.group - 1).bit_length())
    block_q = block_m // shape.group
    q_blocks = rows * t // block_q + rows
    tiles = math.ceil((context + t) / shape.block_n)
    fill = math.ceil(SPLIT_FILL * a.sms / (q_blocks * shape.kv_heads))
    splits = max(1, min(MAX_SPLITS, tiles, fill))
    programs = rows * math.ceil(t / block_q) * shape.kv_heads * splits
    return SplitLaunch(block_q, programs, splits)


def split_partial_bytes(shape: ModelShape, rows: int, t: int, splits: int) -> int:
    """float32 (m, z, acc[d]) of every split, query token and head: written, then read by the
    merge; one layer."""
    return 0 if splits == 1 else 2 * splits * rows * t * shape.heads * (shape.head_dim + 2) * 4


def attention_s(
    shape: ModelShape, rows: int, t: int, context: int, split_kv: bool, a: Assumptions
) -> float:
    """Seconds of attention in one pass, all layers: per layer the slowest of its serial key
    loop (in waves of resident programs), its L2 traffic and its HBM traffic."""
    blocks = math.ceil((context + t) / shape.block_n)  # key tiles of the longest program
    unique = attention_bytes(shape, rows, t, context, True) / shape.layers
    if split_kv:
        launch = split_launch(shape, rows, t, context, a)
        programs, loop_s = launch.programs, math.ceil(blocks / launch.splits) * a.new_iteration_s
        l2_s = 0.0
        unique += split_partial_bytes(shape, rows, t, launch.splits)
    else:
        programs, loop_s = rows * t * shape.heads, blocks * a.old_iteration_s
        l2_s = attention_bytes(shape, rows, t, context, False) / shape.layers / a.l2_bytes_per_s
    loop_s *= math.ceil(programs / (a.sms * a.ctas_per_sm))
    return shape.layers * max(loop_s, l2_s, unique / a.hbm_bytes_per_s)


@dataclass(frozen=True)
class PassCost:
    weights_s: float
    launches: int
    launches_s: float
    attention_s: float

    @property
    def total_s(self) -> float:
        return self.weights_s + self.launches_s + self.attention_s


def pass_cost(
    shape: ModelShape, rows: int, t: int, context: int, design: Design, a: Assumptions
) -> PassCost:
    """One graph replay of `rows` sequences x `t` new tokens over `context` cached keys."""
    stream_s = weight_bytes(shape) / (a.hbm_bytes_per_s * a.gemm_efficiency)
    compute_s = 2 * weight_params(shape) * rows * t / a.bf16_flops
    launches = design.launches(shape, rows, t)
    if design.split_kv and split_launch(shape, rows, t, context, a).merges:
        launches += shape.layers  # the merge kernel beside each attention launch
    return PassCost(
        weights_s=max(stream_s, compute_s),
        launches=launches,
        launches_s=launches * a.kernel_s,
        attention_s=attention_s(shape, rows, t, context, design.split_kv, a),
    )


def sample_s(draws: int, positions: int, vocab: int, design: Design, a: Assumptions) -> float:
    """One sampling call, eager, queued behind the pass it follows: the law over `positions`
    rows of logits, then `draws` tokens drawn."""
    if design.chunked_sampling:
        launches, scan = a.chunked_sample_launches, a.chunked_scan_s
    else:
        launches = a.flat_sample_launches
        scan = a.scan_one_row_s if draws == 1 else a.scan_rows_s
    traffic = a.logit_passes * positions * vocab * 4 / a.hbm_bytes_per_s  # float32 logits
    return launches * a.kernel_s + scan + traffic


# ---- rounds ---------------------------------------------------------------------------------


Method = tuple[str, int, int]  # (method, N, K), as gpu_pairs names them
METHODS: tuple[Method, ...] = (("ar", 1, 0), ("sd", 1, 4), ("smc", 8, 8))


@dataclass(frozen=True)
class Pair:
    name: str
    target: ModelShape
    draft: ModelShape

    @classmethod
    def load(cls, name: str) -> Pair:
        if name not in PAIRS:
            raise ValueError(f"pair: unknown pair {name!r} (known: {', '.join(PAIRS)})")
        target = ModelShape.load(PAIRS[name][0])
        return cls(name, target, ModelShape.load(PAIRS[name][1], vocab=target.vocab))


def round_costs(
    pair: Pair, method: Method, design: Design, a: Assumptions, context: int
) -> dict[str, Any]:
    """The costs dict `roofline.predict` takes, in seconds: target_one is ar's time a token
    (step, sampling, its host wait); a draft step carries its sampling call; the verify
    carries the bonus token's sampling call and the round's host waits."""
    name, n, k = method

    def step(shape: ModelShape, rows: int, t: int) -> float:
        drawn = sample_s(rows, rows * t, pair.target.vocab, design, a)
        return pass_cost(shape, rows, t, context, design, a).total_s + drawn

    ar_wait = design.waits["ar"] * a.host_wait_s
    costs: dict[str, Any] = {"target_one": step(pair.target, 1, 1) + ar_wait}
    if k:
        costs["draft"] = {1: step(pair.draft, 1, 1), n: step(pair.draft, n, 1)}
        verify = step(pair.target, n, k + 1) + design.waits[name] * a.host_wait_s
        costs["verify"] = {(n, k): verify}
    return costs


@dataclass(frozen=True)
class Speed:
    tokens_per_round: float
    round_s: float
    tokens_per_s: float
    speedup: float  # over ar in the same design


def speed(
    pair: Pair, method: Method, design: Design, a: Assumptions, alpha: float, context: int
) -> Speed:
    costs = round_costs(pair, method, design, a, context)
    name, n, k = method
    if name == "ar":
        return Speed(1.0, costs["target_one"], 1 / costs["target_one"], 1.0)
    tokens = sd_tokens_per_round(alpha, k) if name == "sd" else float(k + 1)
    p = predict(costs, n, k, tokens)
    round_s = k * costs["draft"][n] + costs["verify"][(n, k)]
    return Speed(tokens, round_s, tokens / round_s, p["measured_costs"])


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
        "Written by `scripts/gpu_estimate` (`smcspec/bench/gpu_estimate.py`). Every number is "
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
