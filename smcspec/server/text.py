"""From token ids to the text a client sees: stop strings and never-retracted streaming."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[list[int]], str]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string begins in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to withhold while more text may follow: a possible start of
    a stop string, and an unfinished multi-byte character (decoded as U+FFFD)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
        hold += 1
    return hold


class TextStream:
    """Turns growing token lists (tokens that can no longer change) into text deltas.

    `update(tokens)` returns the new text that is safe to send; once a stop string shows up the
    text is cut just before it and `stopped` turns True. `finish(tokens)` sends the rest. Text
    already sent is never taken back.
    """

    def __init__(self, detokenize: Detokenize, stops: Sequence[str] = ()) -> None:
        self.detokenize = detokenize
        self.stops = [s for s in stops if s]
        self.sent = ""
        self.stopped = False
        self.tokens_used = 0  # tokens up to the stop (or all) that produced the text

    def update(self, tokens: list[int]) -> str:
        return self._advance(tokens, final=False)

    def finish(self, tokens: list[int]) -> str:
        """The final text after the last delta; `tokens` is the chosen output."""
        return self._advance(tokens, final=True)

    def _advance(self, tokens: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        text = self.detokenize(tokens)
        cut = first_stop(text, self.stops)
        if cut is not None:
            self.stopped = True
            self.tokens_used = _tokens_before_stop(self.detokenize, tokens, self.stops)
            return self._emit(text[:cut])
        self.tokens_used = len(tokens)
        hold = 0 if final else held_back(text, self.stops)
        return self._emit(text[: len(text) - hold])

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta


def _tokens_before_stop(detokenize: Detokenize, tokens: list[int], stops: Sequence[str]) -> int:
    """The fewest leading tokens whose text holds a stop string (binary search)."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(detokenize(tokens[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    return hi
