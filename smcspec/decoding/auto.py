"""auto: the fastest setting for this request on this machine, chosen as it runs.

Every `redecide_every` rounds, and once more as soon as the committed text prices prompt
lookup (`LookupTally.priced`), a `Tuner` (the engine's, `engine.tuning`) is asked which setting
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
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from smcspec.config import AutoConfig, DecodingConfig, SamplingConfig
from smcspec.decoding.agreement import Tally
from smcspec.decoding.auto_contract import (
    AutoSMCStats,
    AutoStats,
    Choice,
    Finished,
    MakeSetting,
    Outlook,
    ParticleDecoder,
    RoundTime,
    Stepper,
    Tuner,
    reads_text,
)
from smcspec.decoding.base import (
    Call,
    Decoder,
    DecodeResult,
    RoundArgs,
    SharedCaches,
    StageClock,
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


class AutoDecoder(Decoder):
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

    def _decode(self, call: Call) -> DecodeResult:
        prompt, sampling_cfg = call.prompt, call.s
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
            return self._with_potential(run, call)
        choice: Choice | None = self._choose(run, None)
        while choice is not None and not run.done and run.remaining > 0:
            if choice.exact:  # until the end, or until an approximate setting is chosen
                choice = self._exact(run, choice, call, clock)
            else:
                self._approximate(run, choice, call, clock)
                choice = self._choose(run, choice.config)
        seconds, split = clock.finish()
        spread = run.divergences
        divergence = max(spread) if spread else None
        self.tuner.observe(Finished(run.times, sampling_cfg, run.tally, divergence))
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

    def _exact(self, run: _Run, choice: Choice, call: Call, clock: StageClock) -> Choice | None:
        """Rounds of exact settings over one pair of caches, re-choosing every `redecide_every`
        rounds and when lookup is first priced, until the request ends (None) or an approximate
        setting is chosen (its choice)."""
        with released() as held:
            with clock.stage("prefill"):
                caches = SharedCaches(self.target, self.draft, run.seq[0], held)
            since = 0
            args = RoundArgs(run.s, call.generator, clock, len(run.prompt))
            priced = run.lookup.priced
            while not run.done and run.remaining > 0:
                # every R rounds, and as soon as the text prices prompt lookup
                if since == self.config.redecide_every or priced != run.lookup.priced:
                    choice, since = self._choose(run, choice.config), 0
                    priced = run.lookup.priced
                    if not choice.exact:
                        return choice
                stepper = cast(Stepper, self.make(choice.config, None))  # an exact setting
                before = clock.spent()
                step = stepper.step(run.seq, caches, run.remaining, args)
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
                if not run.done and call.watch is not None and call.watch(run.new):
                    run.stopped = run.done = True
        return None

    def _approximate(self, run: _Run, choice: Choice, call: Call, clock: StageClock) -> None:
        """The rest of the request by an approximate (particle) setting, from the committed
        text, until its rounds' mean ESS / N falls below the floor."""
        n = choice.config.particles
        floor = self.config.ess_floor(n) * n  # in ESS, not ESS / N

        def low_ess(pop: Population) -> bool:
            return low_ess_of(pop.ess_history, floor)

        head = list(run.new)
        particles = cast(ParticleDecoder, self.make(choice.config, None))  # approximate
        watch = call.watch
        rest = Call(
            run.prompt,
            dataclasses.replace(run.s, max_new_tokens=run.remaining),
            call.generator,
            None if watch is None else lambda tokens: watch(head + tokens),
        )
        result = particles.resume(rest, head, low_ess)
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

    def _with_potential(self, run: _Run, call: Call) -> DecodeResult:
        """The setting the tuner picks (smc: the conditional needs it), for the whole request."""
        choice = self._choose(run, None)
        result = self.make(choice.config, self.potential).decode(*call)
        segment = run.segments[-1]
        segment.rounds, segment.tokens = result.rounds, len(result.tokens)
        split = result.stage_seconds
        segment.seconds = split["draft"] + split["verify"] + split["resample"]
        smc = result.stats  # smc's: the conditional needs it
        own = {f.name: getattr(smc, f.name) for f in dataclasses.fields(smc)}
        return dataclasses.replace(result, stats=AutoSMCStats(**own, settings=[segment.report()]))


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
