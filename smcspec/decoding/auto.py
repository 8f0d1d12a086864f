"""auto: the fastest setting for this request on this machine, chosen as it runs.

Every `redecide_every` rounds a `Tuner` (the engine's, `engine.tuning`) is asked which setting
decodes fastest now: it predicts each candidate's tokens per second from the machine's measured
step costs and the draft's agreement with the target, a = sum_x min(p, q)(x), which every
drafting round measures exactly at the positions it drafted (`agreement`). The rounds then run
that setting over the request's own caches: ar, sd (one row) and msd (N rows) share one target
cache and one draft cache, which only change their row count (page tables, no copy) and catch
up on the tokens they have not seen with the next round's feed.

Exact. A round of ar, sd or msd emits its tokens from the target's law given the prefix,
whatever the setting, and the setting is picked from what the request has already committed
and measured (never from the round's own draws); so every token is drawn from p given the
tokens before it, and the output's law is p's, as for any one exact method. A seed repeats a
decode while the tuner's costs and prior stay the same (they learn from each request: pin a
method for outputs that a seed alone repeats).

Approximate (`exact=False`): smc is a candidate too. Chosen, it takes over the rest of the
request (its particles need caches of their own: the prefix is fed again, a cost the tuner
weighs) and runs until the mean ESS / N of its rounds falls below `ess_floor(N)` (after a few
rounds), when the answer is drawn from the particles and exact rounds go on from it.

With a potential, the conditional p phi / Z needs smc: the tuner picks its N and K, and smc
decodes the whole request.

Prompt lookup (sd with `proposal` "lookup" or "lookup+draft") is weighed too: its drafts cost no
model step, and what they would keep is measured on the text the exact rounds commit, at every
position, before any lookup round runs (`lookup.LookupTally`). Its rounds' agreement is the
lookup's, not the draft's, so they leave the draft's estimate alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import torch

from smcspec.config import AutoConfig, DecodingConfig, SamplingConfig
from smcspec.decoding.agreement import Tally
from smcspec.decoding.base import (
    Decoder,
    DecodeResult,
    SharedCaches,
    SMCStats,
    StageClock,
    Stats,
    Step,
    Watch,
    check_prompt,
    released,
)
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.lookup import LookupTally
from smcspec.decoding.population import Population
from smcspec.models.base import CausalLM
from smcspec.potentials import Potential

# smc rounds before its mean ESS / N is judged: one round's ESS is a noisy figure
ESS_ROUNDS = 4


class Outlook(NamedTuple):
    """What a choice is made from: the request's settings, the agreement measured so far (its
    sum and positions: the tuner adds its prior), the setting running now (None at the start),
    the committed length (prompt and new tokens) and the new tokens still allowed, whether an
    approximate setting (smc) is allowed (`exact=False`, and its ESS has not failed), the
    rounds and tokens each setting has committed in this request, and what prompt lookup
    would keep on the text so far (None: not measured)."""

    config: AutoConfig
    sampling: SamplingConfig
    has_potential: bool
    agreement_sum: float
    agreement_positions: int
    current: DecodingConfig | None
    context: int
    remaining: int
    approximate_allowed: bool
    measured: Mapping[DecodingConfig, tuple[int, int]]
    lookup: LookupTally | None = None


class Choice(NamedTuple):
    """A setting, its method's name, whether that method is exact, and the tokens per second
    predicted for it."""

    config: DecodingConfig
    method: str
    exact: bool
    predicted: float


class RoundTime(NamedTuple):
    """Rounds of one setting: how many, their committed tokens and their seconds in draft steps
    and in target passes."""

    config: DecodingConfig
    rounds: int
    tokens: int
    draft_seconds: float
    target_seconds: float


class Tuner(Protocol):
    """Chooses settings and learns from what they cost (`engine.tuning.Tuner`)."""

    def choose(self, outlook: Outlook) -> Choice: ...

    def observe(
        self,
        rounds: list[RoundTime],
        sampling: SamplingConfig,
        tally: Tally,
        divergence: float | None = None,
    ) -> None:
        """A finished request's round times, the agreement it measured, and chi^2 / N estimated
        from its smc rounds (`AutoConfig.divergence`; None: it ran none)."""


class Stepper(Decoder, Protocol):
    """An exact method's decoder, which also runs single rounds over shared caches."""

    def step(
        self,
        seq: torch.Tensor,
        caches: SharedCaches,
        remaining: int,
        s: SamplingConfig,
        generator: torch.Generator,
        clock: StageClock,
        prompt_len: int,
    ) -> Step: ...


class ParticleDecoder(Decoder, Protocol):
    """An approximate method's decoder (smc's), which auto runs from the committed text
    (`generated`) until its weights degenerate (`stop_when`)."""

    def decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None = None,
        *,
        generated: Sequence[int] = (),
        stop_when: Callable[[Population], bool] | None = None,
    ) -> DecodeResult: ...


# (settings, potential) -> the decoder of the method whose settings they are: a Stepper for an
# exact method, a ParticleDecoder for an approximate one (the method table's `decoder`)
MakeSetting = Callable[[DecodingConfig, Potential | None], Stepper | ParticleDecoder]


@dataclass
class AutoStats(Stats):
    stopped: bool
    # each setting chosen in turn: its method, N and K where it has them, the round it started
    # at, its rounds, tokens and seconds, and its predicted and measured tokens per second
    settings: list[dict[str, Any]]
    rounds_by_method: dict[str, int]
    proposed_tokens: int  # drafts checked by drafting exact rounds (as sd and msd count them)
    accepted_tokens: int
    draft_agreement: float | None
    agreement_positions: int
    ess: list[float] | None = None  # smc's rounds, when it ran
    _omit_unset = ("ess",)


@dataclass
class AutoSMCStats(SMCStats):
    """smc's figures where auto chose it for the whole request (a potential: the conditional
    needs smc), with the setting it chose, as `AutoStats.settings` reports it."""

    settings: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Segment:
    """The rounds of one chosen setting."""

    choice: Choice
    start: int
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def report(self) -> dict[str, Any]:
        config = self.choice.config
        out: dict[str, Any] = {"method": self.choice.method}
        out |= {k: getattr(config, k) for k in ("particles", "draft_tokens") if hasattr(config, k)}
        if reads_text(config):
            out["proposal"] = config.proposal
        measured = self.tokens / self.seconds if self.seconds > 0 else None
        return out | {
            "from_round": self.start,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "predicted_tokens_per_second": self.choice.predicted,
            "measured_tokens_per_second": measured,
        }


@dataclass
class _Run:
    """One decode's state: the committed tokens, the counts, the segments."""

    prompt: list[int]
    s: SamplingConfig
    approximate_allowed: bool
    lookup: LookupTally
    new: list[int] = field(default_factory=list)
    rounds: int = 0
    done: bool = False
    stopped: bool = False
    proposed: int = 0
    accepted: int = 0
    tally: Tally = field(default_factory=Tally)
    segments: list[_Segment] = field(default_factory=list)
    times: list[RoundTime] = field(default_factory=list)
    measured: dict[DecodingConfig, tuple[int, int]] = field(default_factory=dict)
    scores: list[TokenLogprobs] = field(default_factory=list)
    ess: list[float] | None = None
    divergences: list[float] = field(default_factory=list)  # chi^2 / N of its smc rounds

    @property
    def seq(self) -> torch.Tensor:
        return torch.tensor([self.prompt + self.new], dtype=torch.long)

    @property
    def remaining(self) -> int:
        return self.s.max_new_tokens - len(self.new)

    def commit(self, time: RoundTime, block: list[int]) -> None:
        """Rounds of the current segment's setting that committed `block`."""
        self.new.extend(block)
        self.rounds += time.rounds
        self.times.append(time)
        segment = self.segments[-1]
        segment.rounds += time.rounds
        segment.tokens += len(block)
        segment.seconds += time.draft_seconds + time.target_seconds
        rounds, tokens = self.measured.get(time.config, (0, 0))
        self.measured[time.config] = (rounds + time.rounds, tokens + len(block))


class AutoDecoder:
    """`method="auto"` (the module docstring). `make(config, potential)` builds the decoder of
    the method a chosen config belongs to (its row of the method table); an exact one must also
    `step`."""

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM,
        config: AutoConfig,
        potential: Potential | None,
        tuner: Tuner,
        make: MakeSetting,
    ) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.potential = potential
        self.tuner = tuner
        self.make = make

    def decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None = None,
    ) -> DecodeResult:
        check_prompt(prompt, self.target)
        clock = StageClock()
        most = self.config.draft_tokens or self.config.max_draft_tokens
        run = _Run(
            list(prompt),
            sampling_cfg,
            approximate_allowed=not self.config.exact,
            lookup=LookupTally(start=len(prompt), most=most),
        )
        if self.potential is not None:
            return self._with_potential(run, generator, watch)
        choice: Choice | None = self._choose(run, None)
        while choice is not None and not run.done and run.remaining > 0:
            if choice.exact:  # until the end, or until an approximate setting is chosen
                choice = self._exact(run, choice, generator, watch, clock)
            else:
                self._approximate(run, choice, generator, watch, clock)
                choice = self._choose(run, choice.config)
        seconds, split = clock.finish()
        spread = run.divergences
        divergence = max(spread) if spread else None
        self.tuner.observe(run.times, sampling_cfg, run.tally, divergence)
        logprobs = TokenLogprobs.join(run.scores) if sampling_cfg.logprobs is not None else None
        return DecodeResult(run.new, run.rounds, seconds, split, _stats(run), logprobs=logprobs)

    def _choose(self, run: _Run, current: DecodingConfig | None) -> Choice:
        outlook = Outlook(
            self.config,
            run.s,
            self.potential is not None,
            run.tally.total,
            run.tally.positions,
            current,
            len(run.prompt) + len(run.new),
            run.remaining,
            run.approximate_allowed,
            dict(run.measured),
            run.lookup,
        )
        choice = self.tuner.choose(outlook)
        if not (choice.exact or run.approximate_allowed or self.potential is not None):
            raise RuntimeError(f"the tuner chose an approximate setting where it may not: {choice}")
        if not run.segments or run.segments[-1].choice.config != choice.config:
            run.segments.append(_Segment(choice, run.rounds))
        return choice

    def _exact(
        self,
        run: _Run,
        choice: Choice,
        generator: torch.Generator,
        watch: Watch | None,
        clock: StageClock,
    ) -> Choice | None:
        """Rounds of exact settings over one pair of caches, re-choosing every `redecide_every`
        rounds, until the request ends (None) or an approximate setting is chosen (its choice)."""
        with released() as held:
            with clock.stage("prefill"):
                caches = SharedCaches(self.target, self.draft, run.seq[0], held)
            since = 0
            while not run.done and run.remaining > 0:
                if since == self.config.redecide_every:
                    choice, since = self._choose(run, choice.config), 0
                    if not choice.exact:
                        return choice
                stepper = cast(Stepper, self.make(choice.config, None))  # an exact setting
                before = clock.spent()
                step = stepper.step(
                    run.seq, caches, run.remaining, run.s, generator, clock, len(run.prompt)
                )
                after = clock.spent()
                draft_s, target_s = (after[k] - before[k] for k in ("draft", "verify"))
                run.commit(
                    RoundTime(choice.config, 1, len(step.block), draft_s, target_s), step.block
                )
                since += 1
                run.done = step.done
                run.proposed += step.checked
                run.accepted += step.accepted
                if not reads_text(choice.config):  # a lookup's agreement is not the draft's
                    run.tally.add(step.agreement)
                run.lookup.update(run.prompt + run.new)
                if step.scored is not None:
                    run.scores.append(step.scored)
                if not run.done and watch is not None and watch(run.new):
                    run.stopped = run.done = True
        return None

    def _approximate(
        self,
        run: _Run,
        choice: Choice,
        generator: torch.Generator,
        watch: Watch | None,
        clock: StageClock,
    ) -> None:
        """The rest of the request by an approximate (particle) setting, from the committed
        text, until its rounds' mean ESS / N falls below the floor."""
        n = choice.config.particles
        floor = self.config.ess_floor(n) * n  # in ESS, not ESS / N

        def low_ess(pop: Population) -> bool:
            return low_ess_of(pop.ess_history, floor)

        head = list(run.new)
        particles = cast(ParticleDecoder, self.make(choice.config, None))  # approximate
        result = particles.decode(
            run.prompt,
            dataclasses.replace(run.s, max_new_tokens=run.remaining),
            generator,
            None if watch is None else lambda tokens: watch(head + tokens),
            generated=head,
            stop_when=low_ess,
        )
        split = result.stage_seconds
        clock.add({k: v for k, v in split.items() if k != "other"})
        time = RoundTime(
            choice.config, result.rounds, len(result.tokens), split["draft"], split["verify"]
        )
        run.commit(time, result.tokens)
        run.lookup.skip(len(run.prompt) + len(run.new))
        run.segments[-1].seconds += split["resample"]
        stats = result.stats
        run.ess = (run.ess or []) + list(stats.ess)
        if stats.ess:
            mean = sum(stats.ess) / len(stats.ess) / n
            run.divergences.append(self.config.divergence(max(mean, 1e-9), n))
        if stats.draft_agreement is not None:
            run.tally.merge(stats.draft_agreement, stats.agreement_positions)
        if result.logprobs is not None:
            run.scores.append(result.logprobs)
        if low_ess_of(stats.ess, floor):
            run.approximate_allowed = False  # exact rounds go on from the particle drawn
        tokens = result.tokens
        ended = run.s.stop_at_eos and len(tokens) > 0 and tokens[-1] in self.target.eos_token_ids
        run.stopped = stats.stopped
        run.done = ended or run.stopped or len(tokens) == 0

    def _with_potential(
        self, run: _Run, generator: torch.Generator, watch: Watch | None
    ) -> DecodeResult:
        """The setting the tuner picks (smc: the conditional needs it), for the whole request."""
        choice = self._choose(run, None)
        result = self.make(choice.config, self.potential).decode(
            run.prompt, run.s, generator, watch
        )
        segment = run.segments[-1]
        segment.rounds, segment.tokens = result.rounds, len(result.tokens)
        split = result.stage_seconds
        segment.seconds = split["draft"] + split["verify"] + split["resample"]
        smc = cast(SMCStats, result.stats)
        own = {f.name: getattr(smc, f.name) for f in dataclasses.fields(smc)}
        return dataclasses.replace(result, stats=AutoSMCStats(**own, settings=[segment.report()]))


def setting_label(report: Mapping[str, Any]) -> str:
    """A setting as `AutoStats.settings` reports it, in words: "msd N=2 K=3", "sd K=4 lookup"."""
    sizes = (("particles", "N"), ("draft_tokens", "K"))
    label = report["method"] + "".join(f" {flag}={report[k]}" for k, flag in sizes if k in report)
    return label + (f" {report['proposal']}" if "proposal" in report else "")


def reads_text(config: DecodingConfig) -> bool:
    """Whether a setting's drafts come from the text (sd's lookup proposals)."""
    return getattr(config, "proposal", "draft") != "draft"


def low_ess_of(ess: list[float], floor: float) -> bool:
    """Whether rounds' ESS figures (at least ESS_ROUNDS of them) average below `floor`."""
    return len(ess) >= ESS_ROUNDS and sum(ess) / len(ess) < floor


def _stats(run: _Run) -> AutoStats:
    by_method: dict[str, int] = {}
    for segment in run.segments:
        name = segment.choice.method
        by_method[name] = by_method.get(name, 0) + segment.rounds
    return AutoStats(
        stopped=run.stopped,
        settings=[segment.report() for segment in run.segments],
        rounds_by_method=by_method,
        proposed_tokens=run.proposed,
        accepted_tokens=run.accepted,
        draft_agreement=run.tally.mean,
        agreement_positions=run.tally.positions,
        ess=run.ess,
    )
