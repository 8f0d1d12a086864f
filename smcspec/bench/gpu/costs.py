"""The cost model of the H200 estimate (`gpu.estimate`): seconds of a forward pass, a sampling
call and a round, in the GPU engine's old design and in the new one.

Nothing here ran on a GPU and nothing here is measured. Every number is bytes, FLOPs and kernel
launches counted from the shipped model configs (`gpu.pairs`), priced with the named constants
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
from dataclasses import dataclass
from typing import Any

from smcspec.bench.gpu.assumptions import Assumptions
from smcspec.bench.gpu.pairs import PAIRS, load_config
from smcspec.bench.gpu.runner import sd_tokens_per_round
from smcspec.bench.roofline import predict

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one shipped config (`gpu.pairs.load_config`) that the costs depend on."""

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
        """`vocab` pads a draft's vocabulary to its target's, as `gpu.pairs.build_pair` does."""
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


Method = tuple[str, int, int]  # (method, N, K), as gpu.pairs names them
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
