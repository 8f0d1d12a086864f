"""auto's contract with the tuner that chooses for it and the decoders it runs: what a choice
is made from (`Outlook`), what it returns (`Choice`), what a finished request teaches
(`Finished`, its `RoundTime`s), the two kinds of decoder it drives (`Stepper`,
`ParticleDecoder`), and the statistics it reports (`AutoStats`; `AutoSMCStats` where it ran smc
for the whole request)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from smcspec.config import AutoConfig, DecodingConfig, SamplingConfig
from smcspec.decoding.agreement import Tally
from smcspec.decoding.base import (
    Call,
    Decoder,
    DecodeResult,
    RoundArgs,
    SharedCaches,
    SMCStats,
    Stats,
    Step,
)
from smcspec.decoding.lookup import LookupTally
from smcspec.decoding.population import Population
from smcspec.potentials import Potential


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


class Finished(NamedTuple):
    """What a finished request teaches the tuner: its round times, its sampling settings, the
    agreement it measured, and chi^2 / N estimated from its smc rounds
    (`AutoConfig.divergence`; None: it ran none)."""

    rounds: list[RoundTime]
    sampling: SamplingConfig
    tally: Tally
    divergence: float | None = None


class Tuner(Protocol):
    """Chooses settings and learns from what they cost (`engine.tuning.Tuner`)."""

    def choose(self, outlook: Outlook) -> Choice: ...

    def observe(self, finished: Finished) -> None:
        """Learn from a finished request."""


class Stepper(Protocol):
    """What auto asks of an exact method's `Decoder` beside `decode`: single rounds over shared
    caches."""

    def step(
        self, seq: torch.Tensor, caches: SharedCaches, remaining: int, args: RoundArgs
    ) -> Step: ...


class ParticleDecoder(Protocol):
    """What auto asks of an approximate method's `Decoder` (smc's) beside `decode`: to run from
    the committed text (`generated`) until its weights degenerate (`stop_when`)."""

    def resume(
        self,
        call: Call,
        generated: Sequence[int] = (),
        stop_when: Callable[[Population], bool] | None = None,
    ) -> DecodeResult: ...


# (settings, potential) -> the decoder of the method whose settings they are (the method
# table's `decoder`): a Stepper too for an exact method, a ParticleDecoder too for an
# approximate one
MakeSetting = Callable[[DecodingConfig, Potential | None], Decoder]


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


def setting_label(report: Mapping[str, Any]) -> str:
    """A setting as `AutoStats.settings` reports it, in words: "msd N=2 K=3", "sd K=4 lookup"."""
    sizes = (("particles", "N"), ("draft_tokens", "K"))
    label = report["method"] + "".join(f" {flag}={report[k]}" for k, flag in sizes if k in report)
    return label + (f" {report['proposal']}" if "proposal" in report else "")


def reads_text(config: DecodingConfig) -> bool:
    """Whether a setting's drafts come from the text (sd's lookup proposals)."""
    return getattr(config, "proposal", "draft") != "draft"
