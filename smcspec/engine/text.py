"""From token ids to the text a caller sees: stop strings and never-retracted streaming text.

Decoding the whole output at every update costs O(n) per update and O(n^2) per request.
`TextStream` decodes a window of recent tokens instead, with the offsets vLLM and TGI use:
`read` tokens have settled text, and the text that tokens[read:] add is

    decode(tokens[prefix:]) minus decode(tokens[prefix:read])

where `prefix` is the previous `read`. Offsets only move to a boundary where the decoded text
ends in a complete character (no trailing U+FFFD), where a UTF-8 decoder starts afresh, so for
byte-level BPE the pieces add up to the full decode exactly. Decoders that join words with
spaces or drop a leading space see the tokens before `read` as context and join them right.
(`tokenizers.decoders.DecodeStream` does the same for one `tokenizers.Tokenizer`; this works
for any `detokenize` function, the id-printing one of an LLM without a tokenizer included.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[list[int]], str]


def check_stops(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Stop strings as a tuple: None, one string, or a list of strings, none of them empty."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(
            f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}"
        )
    return tuple(stops)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the stop string completed first begins (of those completed by the same
    character, the longest), or None. First to complete, not to begin: the place a stream cuts
    at once it holds a stop, however its text arrived in pieces."""
    ends = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not ends:
        return None
    end, minus_len = min(ends)
    return end + minus_len


def complete(text: str) -> str:
    """`text` without its trailing U+FFFD: each may be a multi-byte character whose last bytes
    have not come yet, so only the text before them is final. (Bytes that stay invalid decode
    as U+FFFD too; they are told apart once more text follows, or at the end.)"""
    return text.rstrip("\ufffd")


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to withhold while more text may follow: an unfinished
    multi-byte character (decoded as U+FFFD), and before it a possible start of a stop string."""
    done = complete(text)
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(done)), 0, -1):
            if done.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return len(text) - len(done) + hold


class _Window:
    """The text of a growing token list, decoding only tokens[prefix:] (see the module doc)."""

    def __init__(self, detokenize: Detokenize) -> None:
        self.detokenize = detokenize
        self.prefix = 0
        self.read = 0
        self._context = ""  # decode(tokens[prefix:read])

    def tail(self, tokens: list[int], end: int | None = None) -> str:
        """The text tokens[read:end] add to the settled text (may end in U+FFFD)."""
        return self.detokenize(tokens[self.prefix : end])[len(self._context) :]

    def settle(self, tokens: list[int]) -> None:
        """Every token's text is final: move the window past them."""
        context = self.detokenize(tokens[self.read :])
        if context:
            self.prefix, self._context = self.read, context
        else:  # only skipped (special) tokens: no text for the next tokens to join to
            self._context = self.detokenize(tokens[self.prefix :])
        self.read = len(tokens)


class TextStream:
    """Turns growing token lists (tokens that can no longer change) into text deltas.

    `update(tokens)` returns the new text that is safe to send; once a stop string shows up in
    complete characters (an unfinished one's U+FFFD never matches) the text is cut just before
    it and `stopped` turns True. `finish(tokens)` sends the rest. Text
    already sent is never taken back. Each call decodes the tokens added since the last one
    plus the previous call's (bounded work, however long the output).
    """

    def __init__(self, detokenize: Detokenize, stops: str | Sequence[str] | None = ()) -> None:
        self.stops = check_stops(stops)
        self.stopped = False
        self.tokens_used = 0  # tokens up to the stop (or all) that produced the text
        self._window = _Window(detokenize)
        self._sent: list[str] = []
        self._sent_len = 0
        # Settled text from character `_kept_at` on: the part not sent yet, where a stop may be.
        self._kept = ""
        self._kept_at = 0

    @property
    def sent(self) -> str:
        """All the text sent so far."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def update(self, tokens: list[int]) -> str:
        return self._advance(tokens, final=False)

    def finish(self, tokens: list[int]) -> str:
        """The final text after the last delta; `tokens` is the chosen output."""
        return self._advance(tokens, final=True)

    def _advance(self, tokens: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        tail = self._window.tail(tokens)
        unsent = self._unsent(tail)
        cut = first_stop(unsent if final else complete(unsent), self.stops)
        if cut is not None:
            self.stopped = True
            self.tokens_used = self._tokens_to_stop(tokens)
            return self._emit(unsent[:cut])
        self.tokens_used = len(tokens)
        if final or not tail.endswith("\ufffd"):
            self._window.settle(tokens)
            self._kept += tail
        hold = 0 if final else held_back(unsent, self.stops)
        return self._emit(unsent[: len(unsent) - hold])

    def _unsent(self, tail: str) -> str:
        # A stop never begins in sent text: held_back kept any possible start of one.
        return (self._kept + tail)[self._sent_len - self._kept_at :]

    def _emit(self, delta: str) -> str:
        if delta:
            self._sent.append(delta)
            self._sent_len += len(delta)
        drop = min(self._sent_len - self._kept_at, len(self._kept))
        self._kept, self._kept_at = self._kept[drop:], self._kept_at + drop
        return delta

    def _tokens_to_stop(self, tokens: list[int]) -> int:
        """The fewest leading tokens whose text holds a stop string. The settled text holds
        none, so a binary search over the unsettled tokens finds it."""
        lo, hi = self._window.read + 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            unsent = self._unsent(self._window.tail(tokens, mid))
            if first_stop(complete(unsent), self.stops) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi
