"""What a round of each method costs on this machine: the price model auto chooses by.

Costs. `StepCosts` holds, for one (target, draft) pair on one machine, the measured seconds of a
target pass by (rows, tokens per row) and of a draft step by rows, and a fit of each:
    t_target(rows, tokens) = c_t + b_t rows tokens,        t_draft(rows) = c_d + b_d rows.
Affine in the positions a pass carries: the fixed part is what every pass pays whatever its
width (reading the weights once, the launches, Python), the slope what each position adds (its
share of the matmuls and of attention over the context). On a memory-bound device the slope is
near 0 (the paper's model: a wide pass costs a narrow one's time); on a CPU it dominates. Both
regimes are one straight line, and two numbers per model extrapolate off the grid without
inventing a shape the measurements do not show. A shape that was measured is priced by its own
measurement (a GPU's costs step at tile sizes, which no line follows); the fit prices the rest.
`engine.timing` measures the grid, `engine.probes` profiles a pair once per pair, dtype, device,
torch threads and machine (cached as JSON by `engine.cost_cache`); `refresh` blends a request's
own round times in.

Prediction. A round of a method at sd's acceptance probability a = sum_x min(p, q)(x) commits
the tokens its row of the method table gives (`tokens_per_round`; the formulas and msd's model
are in `decoding.round_tokens`) and costs K draft steps and one target pass of K + 1 tokens, at
the rows it keeps (the row's `lookahead` is K, its `kv_rows` the rows):
    ar:         1 token                                      t_target(1, 1)
    sd(K):      (1 - a^(K+1)) / (1 - a)                      K t_draft(1) + t_target(1, K+1)
    msd(N, K):  1 + sum_{d=1..K} P(the walk passes depth d)  K t_draft(N) + t_target(N, K+1)
    smc(N, K):  K + 1                                        K t_draft(N) + t_target(N, K+1)

smc's prediction does not depend on a (it always commits K + 1 tokens) nor grows with N (more
rows only cost more): what N buys is the estimate's quality, which the tuner leaves to the grid
(a smallest N for a potential is set there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from smcspec.config import DecodingConfig
from smcspec.decoding.methods import method_row

# A request's round time is one sample on a machine whose passes jitter by 10-30% (other work
# shares the cores), against the profile's fastest of several: a quarter of the weight lets a
# lasting change take over within a few rounds (half of the old figure is gone after 2.4) while
# one slow round moves the estimate by a quarter of its excess only.
REFRESH_WEIGHT = 0.25

Fit = tuple[float, float]  # seconds: (fixed per pass, per position or per row)


def fit_affine(points: Iterable[tuple[float, float]]) -> Fit:
    """(c, b) of t = c + b x over (x, t) points, by least squares in relative error
    (sum ((c + b x - t) / t)^2): the points span an order of magnitude, and an absolute fit would
    let the widest passes decide the narrow ones' price. Neither is let go below 0 (a slope of
    noise on a flat device is 0, not a pass getting cheaper as it widens)."""
    pts = [(float(x), float(t)) for x, t in points]
    if not pts or any(t <= 0 for _, t in pts):
        raise ValueError("fit_affine needs points with positive times")
    w = [1 / (t * t) for _, t in pts]
    sw = sum(w)
    swx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    swxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    swt = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
    swxt = sum(wi * x * t for wi, (x, t) in zip(w, pts, strict=True))
    det = sw * swxx - swx * swx
    if det <= 1e-12 * sw * swxx:  # one x only: no slope to see
        return swt / sw, 0.0
    c, b = (swxx * swt - swx * swxt) / det, (sw * swxt - swx * swt) / det
    if b < 0:
        return swt / sw, 0.0
    if c < 0:
        return 0.0, swxt / swxx
    return c, b


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a target pass by (rows, tokens per row) and of a draft step by rows, for the
    pair and machine `key` names. A measured shape is priced by its measurement (`target_seen`,
    `draft_seen`), any other by the fit (see the module docstring)."""

    target_fit: Fit
    draft_fit: Fit
    target_seen: Mapping[tuple[int, int], float] = field(default_factory=dict)
    draft_seen: Mapping[int, float] = field(default_factory=dict)
    key: Mapping[str, Any] = field(default_factory=dict)
    # method -> (draft, target) multipliers: a real round's draft steps and verify pass over the
    # bare passes' prices (its sampling laws, draws and accept tests; `measure_rounds`)
    overhead: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # (method, rows, K) -> seconds of a real round, measured (`measure_rounds`)
    rounds_seen: Mapping[tuple[str, int, int], float] = field(default_factory=dict)
    # (method, rows, K) -> the tokens beyond the first a measured round committed over what the
    # method's model predicts at the agreement it measured (`measure_rounds`)
    tokens_seen: Mapping[tuple[str, int, int], float] = field(default_factory=dict)

    # requests whose rows share every pass (`shared`); 1: this request's rows alone
    sharing: int = 1

    def target(self, rows: int, tokens: int) -> float:
        """A pass of `rows` rows of `tokens` each; under `sharing` requests, this request's
        share of the pass they all fill at that shape."""
        return self._pass(rows * self.sharing, tokens) / self.sharing

    def draft(self, rows: int) -> float:
        """A draft step of `rows` rows (this request's share under `sharing`, as `target`)."""
        total = rows * self.sharing
        seen = self.draft_seen.get(total)
        if seen is None:
            c, b = self.draft_fit
            seen = c + b * total
            widest = max(self.draft_seen, default=total)
            if total > widest and c + b * widest > 0:  # past the widest step measured: off
                seen *= self.draft_seen[widest] / (c + b * widest)  # the line as it was there
        return seen / self.sharing

    def _pass(self, rows: int, tokens: int) -> float:
        """A whole target pass: measured, else the fit; past the most rows measured, the fit
        times how far off it was at those rows and this width (a CPU's passes grow faster than
        the line at 8 rows: attention over every row's context, caches spilled)."""
        seen = self.target_seen.get((rows, tokens))
        if seen is not None:
            return seen
        c, b = self.target_fit
        fit = c + b * rows * tokens
        widest = max((r for r, _ in self.target_seen), default=rows)
        at_widest = c + b * widest * tokens
        if rows <= widest or (widest, tokens) not in self.target_seen or at_widest <= 0:
            return fit
        return fit * self.target_seen[(widest, tokens)] / at_widest

    def round_seconds(self, method: str, rows: int, k: int) -> float | None:
        """A real round of `method` at `rows` rows and K = k, from the rounds measured at that
        method and rows: the least-squares line through them along K (`fit_affine`: a round is
        K draft steps and a pass of K + 1 tokens, close to affine in K, and the line smooths a
        noisy point); None where none was measured, or under `sharing` (a round measured alone
        holds the whole fixed part of its passes)."""
        if self.sharing > 1:
            return None
        points = [
            (kk, t) for (m, r, kk), t in self.rounds_seen.items() if m == method and r == rows
        ]
        if not points:
            return None
        c, b = fit_affine(points)
        return c + b * k

    def tokens_scale(self, method: str, rows: int, k: int) -> float:
        """`tokens_seen` at (method, rows, k), or the nearest K measured at those rows; 1 where
        none was (the model as it is)."""
        ks = [kk for m, r, kk in self.tokens_seen if m == method and r == rows]
        if not ks:
            return 1.0
        nearest = min(ks, key=lambda kk: (abs(kk - k), kk))
        return self.tokens_seen[(method, rows, nearest)]

    def shared(self, requests: int) -> StepCosts:
        """The costs of one of `requests` whose rows share every pass (a server's continuous
        batching; `sharing`): the pass they fill together, priced as any pass (measured where
        its shape was, which at 8 rows runs 5-20% over the fit here), split evenly. The fixed
        part of a pass (reading the weights, the launches) is so paid once for all of them,
        and each pays its positions. It assumes the others' rows have this request's shape."""
        if requests <= 1:
            return self
        return replace(self, sharing=requests)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": dict(self.key),
            "target_fit": list(self.target_fit),
            "draft_fit": list(self.draft_fit),
            "target_seen": [[r, t, s] for (r, t), s in sorted(self.target_seen.items())],
            "draft_seen": [[r, s] for r, s in sorted(self.draft_seen.items())],
            "overhead": {m: list(v) for m, v in sorted(self.overhead.items())},
            "rounds_seen": [[m, r, k, s] for (m, r, k), s in sorted(self.rounds_seen.items())],
            "tokens_seen": [[m, r, k, s] for (m, r, k), s in sorted(self.tokens_seen.items())],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepCosts:
        return cls(
            target_fit=tuple(data["target_fit"]),
            draft_fit=tuple(data["draft_fit"]),
            target_seen={(int(r), int(t)): float(s) for r, t, s in data["target_seen"]},
            draft_seen={int(r): float(s) for r, s in data["draft_seen"]},
            key=dict(data["key"]),
            overhead={m: (float(d), float(t)) for m, (d, t) in data.get("overhead", {}).items()},
            rounds_seen={
                (str(m), int(r), int(k)): float(s) for m, r, k, s in data.get("rounds_seen", [])
            },
            tokens_seen={
                (str(m), int(r), int(k)): float(s) for m, r, k, s in data.get("tokens_seen", [])
            },
        )


def from_measurements(
    target_seen: Mapping[tuple[int, int], float],
    draft_seen: Mapping[int, float],
    key: Mapping[str, Any] | None = None,
) -> StepCosts:
    """StepCosts from measured shapes, each model's line fitted to its own points."""
    return StepCosts(
        target_fit=fit_affine((r * t, s) for (r, t), s in target_seen.items()),
        draft_fit=fit_affine(draft_seen.items()),
        target_seen=dict(target_seen),
        draft_seen=dict(draft_seen),
        key=dict(key or {}),
    )


class RoundTimes(NamedTuple):
    """A request's own timings over `rounds` rounds at `rows` rows and `draft_tokens` (K; 0 for
    ar): the seconds its draft steps took in all, and its target passes; `method`, when given,
    also refreshes that method's measured round (`rounds_seen`)."""

    rows: int
    draft_tokens: int
    rounds: int
    draft_seconds: float
    target_seconds: float
    method: str | None = None


def refresh(costs: StepCosts, observed: RoundTimes, weight: float = REFRESH_WEIGHT) -> StepCosts:
    """costs with the observed shapes' prices moved a `weight` of the way to what the request
    measured (an exponential average over the refreshes): the target pass at (rows, K + 1), the
    draft step at rows."""
    rows, k, rounds = observed.rows, observed.draft_tokens, observed.rounds
    if not (rows >= 1 and k >= 0 and rounds >= 1):
        raise ValueError(f"observed needs rows >= 1, draft_tokens >= 0, rounds >= 1: {observed}")
    if not 0 < weight <= 1:
        raise ValueError(f"weight must be in (0, 1], got {weight!r}")
    target_seen = dict(costs.target_seen)
    pass_seconds = observed.target_seconds / rounds
    target_seen[(rows, k + 1)] = (1 - weight) * costs.target(rows, k + 1) + weight * pass_seconds
    draft_seen = dict(costs.draft_seen)
    if k > 0:
        step_seconds = observed.draft_seconds / (rounds * k)
        draft_seen[rows] = (1 - weight) * costs.draft(rows) + weight * step_seconds
    rounds_seen = dict(costs.rounds_seen)
    before = None if observed.method is None else costs.round_seconds(observed.method, rows, k)
    if before is not None:
        per_round = (observed.draft_seconds + observed.target_seconds) / rounds
        rounds_seen[(observed.method, rows, k)] = (1 - weight) * before + weight * per_round
    return replace(costs, target_seen=target_seen, draft_seen=draft_seen, rounds_seen=rounds_seen)


def round_cost(
    method: str, config: DecodingConfig, a: float, costs: StepCosts
) -> tuple[float, float]:
    """(tokens, seconds) of one round of `method` at acceptance probability a: the tokens as
    the method's model has them (`Method.tokens_per_round`; what the profile's and a request's
    rounds measured scale them in one place, `tuning`), the seconds as measured or priced."""
    if not (isinstance(a, int | float) and 0 <= a <= 1):
        raise ValueError(f"a (the acceptance probability) must be in [0, 1], got {a!r}")
    row = method_row(method)
    if row.tokens_per_round is None:
        raise ValueError(f"{method!r} is no one setting: price the settings it chooses from")
    if not isinstance(config, row.config):
        raise ValueError(f"{method!r} takes a {row.config.__name__}, got {config!r}")
    k = row.lookahead(config)
    rows, draft_rows = row.kv_rows(config)
    tokens = row.tokens_per_round(config, a)
    measured = costs.round_seconds(method, rows, k)
    if measured is not None:
        return tokens, measured
    draft_more, target_more = costs.overhead.get(method, (1.0, 1.0))
    draft_seconds = k * costs.draft(draft_rows) * draft_more if k else 0.0
    seconds = draft_seconds + costs.target(rows, k + 1) * target_more
    return tokens, seconds


def predict(method: str, config: DecodingConfig, a: float, costs: StepCosts) -> float:
    """Predicted tokens per second of `method` under `config` at acceptance probability a."""
    tokens, seconds = round_cost(method, config, a, costs)
    return tokens / seconds
