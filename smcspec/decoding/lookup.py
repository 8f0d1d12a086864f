"""Prompt lookup: drafts taken from the text itself, not from a draft model.

Where the output copies its input (an edited function, a summary quoting its source, JSON echoing
a request), the tokens after the text's last n tokens often already stand earlier in the prompt
or the output. `continuation` finds the latest earlier place where the last n tokens occur,
longest n first, and proposes the K tokens that followed it there.

As a proposal this is a point mass: q(x) = 1 at the looked-up token, 0 elsewhere, given the text
so far (the drafts after the first are the lookup's too, a function of the same text). sd's
rules stay exact with it (keep x with probability p(x); the residual max(0, p - q) is p without
x), and a draft costs no model step. smc cannot use it: its weights p / q need a proposal whose
support covers the target's, and a point mass leaves every other token at weight zero, so
particles would all be copies of one text whose weight says nothing about p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# the longest n-gram matched (then n - 1, ... down to 1): llama.cpp's and vLLM's defaults are 3-4
LOOKUP_NGRAM = 3
# the proposals that read the text: sd's `proposal` values other than "draft"
LOOKUP_PROPOSALS = ("lookup", "lookup+draft")
# positions measured before a tally prices lookup (`LookupTally.priced`): fewer say little
LOOKUP_MIN_POSITIONS = 8
# positions back at which a position's weight in the tally's estimate halves (`LookupTally`)
LOOKUP_HALF_LIFE = 8.0


def continuation(tokens: list[int], k: int, ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the text's last n tokens,
    for n = ngram down to 1; [] where none of them occurs earlier (or k is 0)."""
    size = len(tokens)
    for n in range(min(ngram, size - 1), 0, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest first: the nearest context
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def point_masses(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """log q of a point mass at each token: [len(tokens), V], 0 at the token, -inf elsewhere."""
    logq = torch.full((len(tokens), vocab_size), float("-inf"))
    if tokens:
        logq[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logq


class _Open(NamedTuple):
    """A position whose next `most` tokens are not all committed yet."""

    at: int
    proposed: list[int]
    held: int  # how many of the proposal the text holds so far
    seen: int  # how many of its next tokens are committed


@dataclass
class LookupTally:
    """What prompt lookup would keep, measured on text already committed by an exact method,
    at no model cost (auto's estimate, `decoding.auto`).

    At each position i of the generated text, `continuation` of the text before i proposes up
    to `most` tokens; the position counts whether it proposed any and how many of them the text
    then actually holds. That is an unbiased estimate of a lookup round's kept drafts: the
    committed text after i is a draw from p given the text before it (the method was exact),
    and sd keeps a point-mass draft t_j with probability p(t_j | text, t_<j) once the earlier
    ones are kept, so P(a round from i keeps >= j drafts) = P(the text after i starts with
    t_1..t_j). A position is counted (`positions`, `found`, `kept`) once its next `most` tokens
    are committed; the latest ones, whose next tokens are only partly committed, count as
    open (`_open`): each depth j of `drafts_kept` also reads the open positions whose token
    i + j is committed, so the first rounds of a request are priced without waiting `most`
    tokens for every position.

    The estimate weighs recent positions more: a position `half_life` positions before the
    text's end counts half as much as the last (None: all alike). Text copies in stretches (a
    signature, then new code), so the whole text's mean keeps pricing lookup long after the
    copying stopped; the weighted mean estimates what a round from here on keeps."""

    start: int  # the first position measured: the prompt's length
    most: int  # the largest K priced
    ngram: int = LOOKUP_NGRAM
    half_life: float | None = LOOKUP_HALF_LIFE
    positions: int = 0  # positions counted
    # the counted positions' weights, each 0.5 ** ((last - at) / half_life) at the latest
    # counted position `last` (the counts themselves with half_life None): all of them, ...
    weight: float = 0.0
    found: float = 0.0  # ... those where the lookup proposed anything, and per depth j ...
    kept: list[float] = field(default_factory=list)  # ... those matched for >= j + 1 tokens
    last: int = 0
    _end: int = 0  # the text's length at the last update
    _next: int = -1
    _open: list[_Open] = field(default_factory=list)  # recounted at each update
    # per n: each n-gram's latest start indexed so far, and the next start to index
    _latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    _indexed: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.half_life is not None and not self.half_life > 0:
            raise ValueError(f"half_life must be > 0 or None, got {self.half_life}")
        self.kept += [0.0] * (self.most - len(self.kept))

    def _decay(self, positions: int) -> float:
        """The weight of a position `positions` before another."""
        return 1.0 if self.half_life is None else 0.5 ** (positions / self.half_life)

    def update(self, tokens: list[int]) -> None:
        """Count every position of `tokens` (the prompt and the text so far) not yet counted
        whose next `most` tokens are there; keep the later ones open."""
        i = max(self._next, self.start)
        # the open positions' proposals as made, then the new positions' (in order: the index
        # of n-grams only grows)
        pending = [(o.at, o.proposed) for o in self._open]
        pending += [(at, self._continuation(tokens, at)) for at in range(i, len(tokens))]
        self._open = []
        for at, proposed in pending:
            held = 0
            while held < len(proposed) and at + held < len(tokens):
                if proposed[held] != tokens[at + held]:
                    break
                held += 1
            if at + self.most <= len(tokens):
                self._count(at, proposed, held)
            else:
                self._open.append(_Open(at, proposed, held, len(tokens) - at))
        self._next = max(i, len(tokens))
        self._end = max(self._end, len(tokens))

    def _count(self, at: int, proposed: list[int], held: int) -> None:
        """Count position `at`, whose next `most` tokens are committed."""
        aged = self._decay(at - self.last)  # the earlier positions' weights, now older
        self.positions, self.last = self.positions + 1, at
        self.weight = self.weight * aged + 1
        self.found = self.found * aged + bool(proposed)
        self.kept = [kept * aged + (j < held) for j, kept in enumerate(self.kept)]

    def skip(self, length: int) -> None:
        """Count no position before `length`: text an approximate method committed, which is
        not a draw from p (open positions included)."""
        self._next = max(self._next, length)
        self._open = []

    @property
    def measured(self) -> int:
        """Positions measured: counted and open."""
        return self.positions + len(self._open)

    @property
    def priced(self) -> bool:
        """Whether enough positions are measured to price lookup (LOOKUP_MIN_POSITIONS)."""
        return self.measured >= LOOKUP_MIN_POSITIONS

    def _continuation(self, tokens: list[int], i: int) -> list[int]:
        """`continuation(tokens[:i], most, ngram)` from an index of the n-grams before i, kept
        as i grows (the same search, without rescanning the text at every position)."""
        for n in range(min(self.ngram, i - 1), 0, -1):
            latest = self._latest.setdefault(n, {})
            start = self._indexed.get(n, 0)
            # continuation matches the last n tokens at a start <= i - n - 1
            for s in range(start, i - n):
                latest[tuple(tokens[s : s + n])] = s
            self._indexed[n] = max(start, i - n)
            at = latest.get(tuple(tokens[i - n : i]))
            if at is not None:
                return tokens[at + n : min(at + n + self.most, i)]
        return []

    def drafts_kept(self, k: int) -> float:
        """Mean drafts a lookup round of K = k keeps: E[min(match, k)] = sum over j < k of
        P(match > j), each from the positions whose token i + j is committed (the counted
        ones and the open ones that reach depth j), weighed by recency (`half_life`); 0 before
        any position is measured."""
        counted, weights = self._recency()
        total = 0.0
        for j in range(min(k, self.most)):
            held = counted * self.kept[j]
            held += sum(w for w, o in zip(weights, self._open, strict=True) if o.held > j)
            seen = counted * self.weight
            seen += sum(w for w, o in zip(weights, self._open, strict=True) if o.seen > j)
            total += held / seen if seen else 0.0
        return total

    @property
    def found_rate(self) -> float:
        """The share of measured positions where the lookup proposed anything, weighed by
        recency as `drafts_kept` is (0 before any)."""
        counted, weights = self._recency()
        found, seen = counted * self.found, counted * self.weight
        for w, o in zip(weights, self._open, strict=True):
            found, seen = found + w * bool(o.proposed), seen + w
        return found / seen if seen else 0.0

    def _recency(self) -> tuple[float, list[float]]:
        """Weights at the text's end: the factor of the counted sums (kept at `last`) and each
        open position's weight."""
        weights = [self._decay(self._end - o.at) for o in self._open]
        return self._decay(self._end - self.last), weights
