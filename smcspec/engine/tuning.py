"""The chooser behind `method="auto"`: which setting decodes fastest, from measured costs.

A `Tuner` belongs to one loaded pair. Its step costs (`engine.costs`) are profiled on first
use, once per machine and pair (cached on disk), or given. It predicts every candidate's
tokens per second at the request's agreement estimate and picks the highest (`choose`); after
each request it blends the request's own round times into the costs and its agreement into
the prior the next request starts from (`observe`). A request with a seed reads neither (only
the costs as profiled and the default prior), so that its seed repeats its tokens whatever ran
before it; its own rounds' measurements steer it either way, and those repeat with the seed.

The agreement estimate a request's choices read is the running mean of a over the positions it
drafted, with the prior (the mean of earlier requests under the same sampling settings, or
`DEFAULT_AGREEMENT` before any) counted as `PRIOR_POSITIONS` positions: two rounds of sd at
K = 4 outweigh it. A round's tokens come from the method table's model (`round_tokens`), which
for msd is exact only for a point-mass target, and for sd and msd alike assumes one a at every
position; once the request has run rounds of a method, their measured tokens over the model's
(`_measured_scale`) scale its predictions, and an exact drafting method that has not run takes
the scale of those that have.

An approximate setting (smc), chosen while exact rounds run, needs the prefix fed again into
caches of its own: its prediction pays that (`handoff_seconds`) over the tokens left.

sd with a lookup proposal is priced from what the lookup would have kept on the request's own
text (`lookup.LookupTally`, once `lookup.LOOKUP_MIN_POSITIONS` positions are measured): a
position where the lookup proposes is a round of one target pass over K + 1 positions and no
draft step (ar's round, measured, plus the pass's K more positions, from the fit); one where it
proposes nothing is ar's round ("lookup") or a draft round ("lookup+draft"). Those rounds are
left out of the draft's agreement, of the measured scales and of the learned round costs: they
measure the lookup, not the draft.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from smcspec.config import ARConfig, AutoConfig, DecodingConfig, SamplingConfig, SDConfig
from smcspec.decoding.auto_contract import Choice, Finished, Outlook, reads_text
from smcspec.decoding.lookup import LOOKUP_PROPOSALS
from smcspec.decoding.methods import Grid, candidates, method_of, method_row
from smcspec.engine import costs as step_costs
from smcspec.engine.costs import RoundTimes, StepCosts
from smcspec.kv.pages import OutOfPages

# Before a pair has decoded anything under some sampling settings: the middle of the default
# pair's measured sd acceptance on code prompts (0.77 with a draft at T = 2 to 1.00 at T = 0.7;
# benchmarks/cpu/auto-sweep, HumanEval prompts 0-2), where most requests (T <= 1) sit.
DEFAULT_AGREEMENT = 0.9
PRIOR_POSITIONS = 8
# A switch must promise this much more than staying: predictions from a few positions are
# noisy, and a switch costs a re-choice's worth of rows changing shape.
SWITCH_MARGIN = 0.03
# How much of the prior a finished request's mean replaces.
PRIOR_WEIGHT = 0.3


def sampling_key(s: SamplingConfig) -> tuple:
    """The settings that move agreement: both temperatures and the truncations."""
    return (s.temperature, s.draft_temperature, s.top_k, s.top_p, s.min_p)


def grid_for(config: AutoConfig) -> Grid:
    """Every K up to the most, N = 2, 4, 8, ... up to the most; only the N and K a request
    gives where it gives them (then without the methods that do not read them: ar and sd for
    N, ar for K). smc takes N = 2 where the most is 1 (fewer is no population)."""
    if config.particles is not None:
        ns = [config.particles]
    else:
        ns, n = [], 2
        while n <= config.max_particles:
            ns.append(n)
            n *= 2
    if config.draft_tokens is not None:
        ks: tuple[int, ...] = (config.draft_tokens,)
    else:
        ks = tuple(range(1, config.max_draft_tokens + 1))
    given_n, given_k = config.particles is not None, config.draft_tokens is not None
    return Grid(
        draft_tokens=ks,
        msd_particles=tuple(ns),
        smc_particles=tuple(ns) or (2,),
        ar=not (given_n or given_k),
        sd=not given_n,
        lookup=LOOKUP_PROPOSALS,
    )


def min_divergence(a: float, draft_tokens: int, particles: int) -> float:
    """The least chi^2 / N that smc's rounds of K drafts can have where sd's acceptance is a:
    at a position, chi^2(p || q) >= 4 TV(p, q)^2 = 4 (1 - a)^2 (TV <= sqrt(chi^2) / 2), and a
    round weighs K positions, 1 + chi^2 = prod_k (1 + chi^2_k) (independent positions; the bonus
    token is exact). A setting over `AutoConfig.max_divergence` by this bound would fail it
    however its weights fall, so the tuner leaves it out: a seeded request, which keeps no
    history of smc's ESS, never starts smc only to hand back after a few rounds."""
    per_position = 4 * (1 - a) ** 2
    return ((1 + per_position) ** draft_tokens - 1) / particles


def handoff_seconds(costs: StepCosts, context: int) -> float:
    """Feeding `context` positions to the target and the draft again, priced by the fits (a
    pass of many positions is priced as that many rows of one: an upper bound, prefill batches
    better)."""
    return costs.target(1, context) + costs.draft(context)


class Tuner:
    """Chooses settings for `decoding.auto` from the costs `source` gives (called once, on the
    first choice; `costs` replaces them) and learns from finished requests."""

    def __init__(self, source: Callable[[], StepCosts]) -> None:
        self._source = source
        self._baseline: StepCosts | None = None  # as profiled (or given)
        self._costs: StepCosts | None = None  # with the requests' times blended in
        self._priors: dict[tuple, float] = {}
        self._divergence: dict[tuple, float] = {}  # smc's chi^2 / N by sampling settings
        self._lock = threading.Lock()
        # requests sharing each forward pass now (a server sets it to its scheduler's running
        # count): unseeded requests are priced at the marginal cost of their rows
        self.sharing: Callable[[], int] = lambda: 1

    @classmethod
    def fixed(cls, costs: StepCosts) -> Tuner:
        return cls(lambda: costs)

    @property
    def costs(self) -> StepCosts:
        """The costs, learned from the requests so far."""
        with self._lock:
            if self._costs is None:
                try:
                    measured = self._source()
                except OutOfPages as err:  # a KV pool too small to profile in
                    print(
                        f"smcspec: auto's step costs not measured ({err}); it prices every "
                        "position alike",
                        file=sys.stderr,
                    )
                    measured = StepCosts(target_fit=(1.0, 0.0), draft_fit=(0.1, 0.0))
                self._baseline = self._costs = measured
            return self._costs

    @costs.setter
    def costs(self, value: StepCosts) -> None:
        with self._lock:
            self._baseline = self._costs = value

    def costs_for(self, s: SamplingConfig) -> StepCosts:
        """A seeded request's choices read the costs as profiled, the others' the learned ones
        at the marginal price of their rows among the requests sharing each pass (`shared`):
        a seed must give the same tokens, whatever requests came before or run beside it."""
        learned = self.costs
        if s.seed is not None:
            return self._baseline or learned
        return learned.shared(self.sharing())

    def prior(self, s: SamplingConfig) -> float:
        """The agreement a request starts from: earlier requests' under the same sampling
        settings, DEFAULT_AGREEMENT before any, or with a seed (see `costs_for`)."""
        if s.seed is not None:
            return DEFAULT_AGREEMENT
        return self._priors.get(sampling_key(s), DEFAULT_AGREEMENT)

    def agreement(self, outlook: Outlook) -> float:
        """The request's running mean of a, with the prior counted as PRIOR_POSITIONS."""
        prior = self.prior(outlook.sampling)
        total = outlook.agreement_sum + prior * PRIOR_POSITIONS
        return min(1.0, max(0.0, total / (outlook.agreement_positions + PRIOR_POSITIONS)))

    def predictions(self, outlook: Outlook) -> list[Choice]:
        """Every candidate with its predicted tokens per second, simplest first."""
        costs, a = self.costs_for(outlook.sampling), self.agreement(outlook)
        config = outlook.config
        grid = grid_for(config)
        exact = not self.smc_allowed(outlook)
        out = []
        for name, cfg in candidates(grid, exact, outlook.has_potential):
            row = method_row(name)
            if not (row.exact or outlook.has_potential) and (
                min_divergence(a, cfg.draft_tokens, cfg.particles) > config.max_divergence
            ):
                continue  # its weights would degenerate past the bound, whatever q does
            if reads_text(cfg):
                priced = _lookup_round(cfg, a, costs, outlook)
                if priced is None:
                    continue  # too little text measured yet
                tokens, seconds = priced
            else:
                tokens, seconds = step_costs.round_cost(name, cfg, a, costs)
                tokens = 1 + (tokens - 1) * _tokens_scale(outlook, name, cfg, a, costs)
            rate = tokens / seconds
            if not row.exact and outlook.current is not None:
                rate = _with_handoff(rate, costs, outlook)
            out.append(Choice(cfg, name, row.exact, rate))
        return out

    def choose(self, outlook: Outlook) -> Choice:
        options = self.predictions(outlook)
        if not options:
            raise ValueError("auto has no setting to choose from")
        best = max(options, key=lambda c: c.predicted)
        current = next((c for c in options if c.config == outlook.current), None)
        if current is not None and best.predicted < current.predicted * (1 + SWITCH_MARGIN):
            return current
        return best

    def smc_allowed(self, outlook: Outlook) -> bool:
        """Whether smc may be weighed: approximate asked for and its ESS not failed in this
        request, nor (unseeded) in earlier ones under the same sampling settings, whose chi^2 / N
        (from their ESS) the tuner keeps."""
        if not outlook.approximate_allowed:
            return False
        if outlook.sampling.seed is not None:
            return True
        seen = self._divergence.get(sampling_key(outlook.sampling))
        return seen is None or seen <= outlook.config.max_divergence

    def observe(self, finished: Finished) -> None:
        """Blend a finished request's round times into the costs (each setting's rounds as one
        observation, `costs.refresh`; not while other requests run, whose rows its passes
        carried), its mean agreement into the prior and its smc rounds' chi^2 / N into the one
        kept for its sampling settings."""
        rounds, sampling, tally, divergence = finished
        totals: dict[DecodingConfig, list[float]] = {}
        if self.sharing() > 1:  # its passes held other requests' rows: not its own price
            rounds = []
        for r in rounds:
            if reads_text(r.config):  # a lookup round's cost is not sd's draft round's
                continue
            t = totals.setdefault(r.config, [0, 0.0, 0.0])
            t[0] += r.rounds
            t[1] += r.draft_seconds
            t[2] += r.target_seconds
        costs = self.costs
        for config, (count, draft_s, target_s) in totals.items():
            row = method_row(method_of(config))
            rows = row.kv_rows(config)[0]
            seen = RoundTimes(rows, row.lookahead(config), int(count), draft_s, target_s, row.name)
            costs = step_costs.refresh(costs, seen)
        with self._lock:
            self._costs = costs
            key = sampling_key(sampling)
            mean = tally.mean
            if mean is not None and tally.positions >= 4:
                old = self._priors.get(key, DEFAULT_AGREEMENT)
                self._priors[key] = (1 - PRIOR_WEIGHT) * old + PRIOR_WEIGHT * mean
            if divergence is not None:
                old = self._divergence.get(key, divergence)
                self._divergence[key] = (1 - PRIOR_WEIGHT) * old + PRIOR_WEIGHT * divergence


def _tokens_scale(
    outlook: Outlook, method: str, config: DecodingConfig, a: float, costs: StepCosts
) -> float:
    """The one scale on a setting's modelled tokens beyond the first: what the profile's rounds
    of its method, rows and K committed over the model's (`StepCosts.tokens_scale`), times what
    this request's rounds did over that (`_measured_scale`)."""
    row = method_row(method)
    rows, k = row.kv_rows(config)[0], row.lookahead(config)
    return costs.tokens_scale(method, rows, k) * _measured_scale(outlook, method, a, costs)


def _measured_scale(outlook: Outlook, method: str, a: float, costs: StepCosts) -> float:
    """A method's measured tokens beyond the first per round over its model's (the table's
    `tokens_per_round` at a), from this request's rounds of any of its settings, each side
    with PRIOR_POSITIONS / 4 rounds of the model added; 1 where none ran. It corrects msd's
    model (exact only for a point-mass target), and for sd and msd alike what the mean a leaves
    out: where a varies along the text, a round passes K positions with probability the mean of
    prod a_i, below the mean a to the K. So an exact drafting method (sd, msd) that has not run
    in this request takes the scale of those that have: else a method that ran would be
    corrected and one that did not would keep its model's optimism, and win on that alone. The
    model it divides by is the profile's scaled one (`_tokens_scale`)."""
    row = method_row(method)
    own = _scale_of(outlook, a, costs, lambda r: r.name == row.name)
    if own is not None:
        return own
    if not row.exact:  # smc commits K + 1 whatever a (ar's one token takes no scale either)
        return 1.0
    pooled = _scale_of(outlook, a, costs, lambda r: r.exact)
    return 1.0 if pooled is None else pooled


def _scale_of(
    outlook: Outlook, a: float, costs: StepCosts, counts: Callable[[Any], bool]
) -> float | None:
    """Measured over predicted tokens beyond the first, over the settings of the methods
    `counts` takes, with PRIOR_POSITIONS / 4 rounds of the model on each side; None where none
    of them ran."""
    rounds = measured = predicted = 0.0
    for cfg, (n, tokens) in outlook.measured.items():
        row = method_row(method_of(cfg))
        if reads_text(cfg):  # the lookup's tokens, not the draft model's
            continue
        if counts(row) and row.lookahead(cfg) > 0:  # rounds without drafts say nothing
            rounds += n
            measured += tokens - n
            k, rows = row.lookahead(cfg), row.kv_rows(cfg)[0]
            predicted += (
                (row.tokens_per_round(cfg, a) - 1) * costs.tokens_scale(row.name, rows, k) * n
            )
    if rounds == 0 or predicted <= 0:
        return None
    prior = PRIOR_POSITIONS / 4 * predicted / rounds
    return (measured + prior) / (predicted + prior)


def _with_handoff(rate: float, costs: StepCosts, outlook: Outlook) -> float:
    """smc's tokens per second over the tokens left, paying the prefix fed again."""
    remaining = max(1, outlook.remaining)
    return remaining / (remaining / rate + handoff_seconds(costs, outlook.context))


def _lookup_round(
    config: SDConfig, a: float, costs: StepCosts, outlook: Outlook
) -> tuple[float, float] | None:
    """(expected tokens, seconds) of a round of sd with a lookup proposal (the module
    docstring); None before the tally has measured enough positions (`LookupTally.priced`)."""
    tally = outlook.lookup
    if tally is None or not tally.priced:
        return None
    k, found = config.draft_tokens, tally.found_rate
    _, step = step_costs.round_cost("ar", ARConfig(), a, costs)
    looked = step + max(0.0, costs.target(1, k + 1) - costs.target(1, 1))
    kept = tally.drafts_kept(k)  # 0 at the positions where nothing was proposed
    if config.proposal == "lookup":
        return 1 + kept, found * looked + (1 - found) * step
    tokens, seconds = step_costs.round_cost("sd", SDConfig(k), a, costs)
    tokens = 1 + (tokens - 1) * _tokens_scale(outlook, "sd", SDConfig(k), a, costs)
    return 1 + kept + (1 - found) * (tokens - 1), found * looked + (1 - found) * seconds
