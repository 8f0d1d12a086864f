"""What every decoder shares: the interface, the result record, stage timing and cache feeding."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import torch

from smcspec.config import SamplingConfig
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.models.base import CausalLM, KVCache

C = TypeVar("C")  # a method's settings (`Drafted.config`)

STAGES = ("prefill", "draft", "verify", "resample", "other")


@dataclass
class Stats:
    """A method's own figures. `to_dict` gives the keys they have in `diagnostics` (and JSON);
    a field named in `_omit_unset` is left out while None (it exists only with a potential)."""

    _omit_unset: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if not (k in self._omit_unset and v is None)}


@dataclass
class ARStats(Stats):
    stopped: bool  # a watch (a stop string, a hang-up) ended decoding
    complete: bool | None = None  # with a potential: the constraint was met
    _omit_unset = ("complete",)


@dataclass
class SDStats(Stats):
    stopped: bool
    proposed_tokens: int  # drafts checked (up to and including each round's first rejection)
    accepted_tokens: int
    # None, not NaN, when nothing was drafted (max_new_tokens = 1): JSON has no NaN.
    acceptance_rate: float | None  # accepted / proposed
    mean_accepted_length: float | None  # accepted drafts per round
    tokens_per_round: float | None  # committed tokens per round
    # a = sum_x min(p(x), q(x)) at each draft checked (those of proposed_tokens), the
    # probability that sd keeps a draft there, averaged (acceptance_rate is its sample)
    draft_agreement: float | None = None
    agreement_positions: int = 0  # the positions averaged


@dataclass
class SMCStats(Stats):
    stopped: bool
    ess: list[float]  # effective sample size after each round
    resamples: int
    collapses: int  # rounds replaced by an exact step (every weight zero)
    weights: list[float]  # final normalized weights W_i
    log_z_hat: float
    chosen_particle: int
    valid_particles: int | None = None  # with a potential: particles of nonzero weight
    # with a potential: why particles died (a reward that raised, a matcher that gave up, a
    # mask the sampling settings emptied), each reason once, at most 10
    potential_errors: list[str] | None = None
    # a = sum_x min(p(x), q(x)) (see `agreement`), averaged over every live particle's drafted
    # positions of every round, up to and including its first drafted EOS; p and q are the
    # adjusted laws of target and draft, a potential's shaping left out (as sd would test them)
    draft_agreement: float | None = None
    agreement_positions: int = 0  # the (particle, position) pairs averaged
    _omit_unset = ("valid_particles", "potential_errors")


@dataclass
class MSDStats(Stats):
    stopped: bool
    accepted_tokens: int  # drafts committed (up to and including a kept EOS)
    accepted_lengths: list[int]  # each round: the depth its tree walk reached (drafts accepted)
    # at depth d + 1: of the rounds whose walk got there with drafts left, the share accepting
    # one (None where none got there)
    acceptance_by_depth: list[float | None]
    mean_accepted_length: float | None  # None, not NaN, when nothing was drafted
    tokens_per_round: float | None
    # nodes whose drafts the walk tested: each round's path up to and including the node where
    # all were rejected (or its last drafted depth), cut after a kept EOS, as sd's
    proposed_tokens: int = 0
    # a = sum_x min(p(x), q(x)) at each of those nodes, with the node's p and q, averaged
    draft_agreement: float | None = None
    agreement_positions: int = 0  # the nodes averaged


@dataclass
class DecodeResult:
    """Generated token ids (EOS included when it ended the sequence) and diagnostics.

    `stats` holds the method's own figures (`ARStats`, `SDStats`, `SMCStats`, `MSDStats`).
    `particles` holds every final particle's tokens for smc; `logprobs` the tokens'
    log-probabilities when the sampling config asks for them.
    """

    tokens: list[int]
    rounds: int
    seconds: float
    stage_seconds: dict[str, float]
    stats: Stats
    particles: list[list[int]] | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


Watch = Callable[[list[int]], bool]
"""Called after every round with the tokens that can no longer change (all committed tokens for
ar and sd; the particles' common prefix for smc), so callers can stream them. Returning True
stops decoding: the caller has seen what it needs (a stop string) or no longer wants the rest."""


class Call(NamedTuple):
    """One request as a decoder's `_decode` receives it: `Decoder.decode`'s four arguments."""

    prompt: list[int]
    s: SamplingConfig
    generator: torch.Generator
    watch: Watch | None


class Decoder:
    """What every decoder shares (ar, sd, msd, smc, auto): `decode` runs `prompt` under
    `sampling_cfg`, drawing every random number from `generator`, and reports to `watch` after
    every round. A method writes `_decode(call)`; `decode` is the one public door, and runs it
    without autograd (`no_autograd`)."""

    def decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None = None,
    ) -> DecodeResult:
        with no_autograd():
            return self._decode(Call(prompt, sampling_cfg, generator, watch))

    def _decode(self, call: Call) -> DecodeResult:
        raise NotImplementedError


class Drafted(Decoder, Generic[C]):
    """A decoder of a target, a draft and its method's settings (sd's, msd's)."""

    def __init__(self, target: CausalLM, draft: CausalLM, config: C) -> None:
        self.target = target
        self.draft = draft
        self.config = config


class RoundArgs(NamedTuple):
    """What every round of one request reads beside its text (ar's, sd's and msd's, whether
    their own decode or auto runs them): the sampling settings, the generator, the stage clock,
    and the prompt's length (penalties leave the prompt out)."""

    s: SamplingConfig
    generator: torch.Generator
    clock: StageClock
    prompt_len: int


class StageClock:
    """Wall time split into named stages; whatever no stage claims is 'other'."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._spent = dict.fromkeys(STAGES[:-1], 0.0)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spent[name] += time.perf_counter() - t0

    def spent(self) -> dict[str, float]:
        """Seconds each named stage has taken so far."""
        return dict(self._spent)

    def add(self, seconds: dict[str, float]) -> None:
        """Count stage seconds spent elsewhere (a decoder run inside this one's time)."""
        for name, value in seconds.items():
            self._spent[name] += value

    def finish(self) -> tuple[float, dict[str, float]]:
        total = time.perf_counter() - self._start
        split = dict(self._spent)
        split["other"] = max(0.0, total - sum(split.values()))
        return total, split


class Step(NamedTuple):
    """One round of an exact method run by `step` (for auto): the committed tokens, whether an
    EOS ended decoding, the drafts checked and accepted, `agreement` at the drafts checked, and
    the tokens' scores when asked for."""

    block: list[int]
    done: bool
    checked: int
    accepted: int
    agreement: torch.Tensor
    scored: TokenLogprobs | None


class SharedCaches:
    """The target's and the draft's caches of a decode whose rounds change method (auto): each
    holds the committed text (or lags behind it: a round feeds what a cache has not seen) in as
    many rows as the last round left, every row the same text. The draft's is made (its prefix
    fed) when a round first drafts; `held` (see `released`) frees both."""

    def __init__(
        self, target: CausalLM, draft: CausalLM, seq: torch.Tensor, held: list[KVCache]
    ) -> None:
        self._models = (target, draft)
        self._held = held
        self.target = start_cache(target, seq, 1, held)
        self._draft: KVCache | None = None

    def draft(self, seq: torch.Tensor) -> KVCache:
        """The draft's cache; made from seq [T] (the committed text) the first time."""
        if self._draft is None:
            self._draft = start_cache(self._models[1], seq, 1, held=self._held)
        return self._draft

    @staticmethod
    def rows(cache: KVCache, rows: int) -> KVCache:
        """cache with `rows` rows, copies of its first (they all hold the same text)."""
        if cache.batch_size != rows:
            cache.select(torch.zeros(rows, dtype=torch.long))
        return cache

    def made(self) -> list[KVCache]:
        return [c for c in (self.target, self._draft) if c is not None]

    def restart(self, seq_len: int, rows: int, winner: int = 0) -> None:
        """After a round: `restart_rows` on every cache made."""
        restart_rows(self.made(), seq_len, rows, winner)


def restart_rows(caches: list[KVCache], seq_len: int, rows: int, winner: int) -> None:
    """After a round: crop each cache to the committed text's seq_len - 1 (`rollback`) and give
    it `rows` rows, each a copy of row `winner` (page tables, no copy). Rows beside the winner
    hold their own drafts below seq_len - 1, so they are always replaced; only a lone row that
    is the winner stays as it is."""
    for cache in caches:
        rollback(cache, seq_len)
        if not (cache.batch_size == rows == 1 and winner == 0):
            cache.select(torch.full((rows,), winner, dtype=torch.long))


def check_prompt(prompt: list[int], model: CausalLM) -> None:
    if len(prompt) == 0:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(
            f"prompt has token ids outside the vocabulary [0, {model.vocab_size}): {bad[:5]}"
        )


def start_cache(
    model: CausalLM, prompt: torch.Tensor, rows: int, held: list[KVCache] | None = None
) -> KVCache:
    """A cache holding all but the last prompt token (which is fed with the first new tokens),
    replicated to `rows` rows. prompt [L]. The cache is added to `held` (see `released`)
    before anything can fail."""
    cache = model.new_cache()
    if held is not None:
        held.append(cache)
    if prompt.numel() > 1:
        model.forward(prompt[None, :-1], cache, 1)
    if rows > 1:
        cache.select(torch.zeros(rows, dtype=torch.long))
    return cache


def no_autograd() -> torch.inference_mode:
    """What every `Decoder.decode` runs its method under: no autograd records on a round's
    hundred small operations (a toy-model decode 16-19% faster, one thread). A fresh context
    each call, so threads decoding at once share none. What a decode returns holds lists, not
    tensors, so no inference-mode tensor reaches the caller."""
    return torch.inference_mode()


@contextmanager
def released() -> Iterator[list[KVCache]]:
    """A list that `start_cache` registers caches in; their memory goes back when the block
    ends, however it ends (an exception in a prefill included)."""
    held: list[KVCache] = []
    try:
        yield held
    finally:
        for cache in held:
            cache.release()


class Opening(NamedTuple):
    """A decode's start (`opened`): its clock, the prompt as [1, L], and one cache per model
    asked for (None where the model was None)."""

    clock: StageClock
    seq: torch.Tensor
    caches: tuple[KVCache | None, ...]


@contextmanager
def opened(prompt: list[int], rows: int, *models: CausalLM | None) -> Iterator[Opening]:
    """How every decoder that runs its own caches opens: the prompt checked against the first
    model, the clock started, and a cache per model holding the prompt in `rows` rows, filled
    under the "prefill" stage; the caches go back when the block ends, however it ends."""
    first = next(m for m in models if m is not None)
    check_prompt(prompt, first)
    clock = StageClock()
    seq = torch.tensor([prompt], dtype=torch.long)  # [1, L]
    with released() as held:
        with clock.stage("prefill"):
            caches = tuple(
                None if m is None else start_cache(m, seq[0], rows, held) for m in models
            )
        yield Opening(clock, seq, caches)


def pending(seqs: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The tokens of seqs [B, L] that the cache has not seen yet: [B, L - cache.length]."""
    return seqs[:, cache.length :]


def rollback(cache: KVCache, seq_len: int) -> None:
    """After committing tokens, drop cached positions that may hold rejected drafts.

    Everything except the newest committed token was either fed exactly or not at all, so the
    cache stays valid up to seq_len - 1.
    """
    if cache.length > seq_len - 1:
        cache.crop(seq_len - 1)
