"""Potentials: factors phi(x) on whole sequences, so that SMC samples  p(x) phi(x) / Z.

A potential speaks through up to four hooks, each optional:
- `exponent` e: phi contains p(x)^e, the target's own probability (Power(alpha): e = alpha - 1);
- `allowed(state)`: a bool mask [V] of next tokens that keep x completable (a hard constraint);
- `log_value(tokens, final)`: the log of a sequence-level factor as a function of the prefix (a
  reward, or a twisted reward on prefixes); the sampler evaluates it after every round and at the
  end and adds the change since the last evaluation, so intermediate values telescope away and
  the target is exactly p(x) exp(log_value(x, final=True));
- `log_end(state)`: a last factor on a sequence cut at max_new_tokens (0 or -inf for constraints).
Per-particle state: `start()`, `advance(state, token)`, `copy(state)` (resampling duplicates);
`error(state)` says why a state allows nothing, when it can.
Potentials combine by product (`Product`, or `a * b`). A decode whose every sequence ends in a
dead end raises `ConstraintError` rather than return text that breaks the potentials.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from smcspec import grammars

# Tokens a new constraint is walked before it is accepted: a lexer that runs out of fuel inside
# a regex does so at the mask after its first token there (a{1000000}: after one "a"); the
# second token is a margin.
PROBE_TOKENS = 2


class ConstraintError(ValueError):
    """No output can satisfy the potentials: every sequence reached a dead end (llguidance gave
    up on the grammar, the sampling settings leave none of the tokens it allows, or a reward
    raised). A sequence merely cut at max_new_tokens is not one: that ends as "length"."""


class Potential:
    exponent: float = 0.0
    has_value: bool = False  # whether log_value is defined
    has_mask: bool = False  # whether allowed() can return a mask

    def start(self) -> Any:
        return None

    def advance(self, state: Any, token: int) -> Any:
        return state

    def copy(self, state: Any) -> Any:
        return state

    def allowed(self, state: Any) -> torch.Tensor | None:
        return None

    def log_value(self, tokens: list[int], final: bool) -> float:
        return 0.0

    def log_end(self, state: Any) -> float:
        return 0.0

    def error(self, state: Any) -> str | None:
        """Why `allowed(state)` allows nothing, when the potential knows (a matcher that gave
        up); None otherwise."""
        return None

    def __mul__(self, other: Potential) -> Product:
        return Product([self, other])


class Power(Potential):
    """p(x)^alpha over whole sequences (not per-token temperature 1/alpha: the two differ
    whenever later tokens' normalizers depend on earlier choices)."""

    def __init__(self, alpha: float) -> None:
        if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"power alpha must be a finite number > 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.exponent = self.alpha - 1.0


class Reward(Potential):
    """exp(beta * r(x)) with r a function of the generated token ids and a flag `final`.

    every=None: r is applied once, at the end. every=m: also on prefixes, cut to the last
    multiple of m tokens (a twist that guides the particles early; it telescopes away)."""

    has_value = True

    def __init__(
        self, fn: Callable[[list[int], bool], float], beta: float = 1.0, every: int | None = None
    ) -> None:
        if not callable(fn):
            raise ValueError(f"reward must be callable, got {fn!r}")
        if not isinstance(beta, int | float) or not math.isfinite(beta):
            raise ValueError(f"reward beta must be a finite number, got {beta!r}")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"reward every must be an integer >= 1, got {every!r}")
        self.fn, self.beta, self.every = fn, float(beta), every
        self._memo: dict[tuple[int, ...], float] = {}

    def log_value(self, tokens: list[int], final: bool) -> float:
        if final:
            return self._call(tuple(tokens), True)
        if self.every is None or len(tokens) < self.every:
            return 0.0
        cut = tuple(tokens[: len(tokens) // self.every * self.every])
        if cut not in self._memo:
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[cut] = self._call(cut, False)
        return self._memo[cut]

    def _call(self, tokens: tuple[int, ...], final: bool) -> float:
        value = self.fn(list(tokens), final)
        if not isinstance(value, int | float) or math.isnan(value):
            raise ValueError(f"reward must return a number, got {value!r}")
        return self.beta * float(value)


class TokenRule(Potential):
    """A hard constraint given as a function from the token ids so far to the allowed next
    tokens (a bool mask [V]) and a test of completeness. For small vocabularies and tests;
    `Constraint` is the text-level one."""

    has_mask = True

    def __init__(
        self,
        allowed: Callable[[tuple[int, ...]], torch.Tensor],
        complete: Callable[[tuple[int, ...]], bool],
    ) -> None:
        self._allowed, self._complete = allowed, complete

    def start(self) -> tuple[int, ...]:
        return ()

    def advance(self, state: tuple[int, ...], token: int) -> tuple[int, ...]:
        return (*state, token)

    def allowed(self, state: tuple[int, ...]) -> torch.Tensor:
        return self._allowed(state)

    def log_end(self, state: tuple[int, ...]) -> float:
        return 0.0 if self._complete(state) else -math.inf


class Constraint(Potential):
    """The text must match a regular expression, a JSON schema or a Lark grammar (llguidance).

    The target is p restricted to the language and renormalized: the exact conditional. Each
    particle carries an llguidance matcher; `allowed` is its token mask (EOS only where the text
    is complete); a sequence cut at max_new_tokens before completion gets weight zero.

    The grammar compiles here, under `grammars.GRAMMAR_LIMITS`, and is walked for its first
    `PROBE_TOKENS` tokens, as is every regex of its JSON schemas (`pattern`, `patternProperties`):
    one that llguidance already gives up on is a ValueError before any decoding. One it gives up
    on later kills every particle there (they share its lexer): the decode raises
    `ConstraintError`.
    """

    has_mask = True

    def __init__(
        self, grammar: str, tokenizer: Any, vocab_size: int, what: str = "grammar"
    ) -> None:
        self.tokenizer = grammars.llguidance_tokenizer(tokenizer, vocab_size)
        grammars.validate(grammar, self.tokenizer, what)
        self.grammar, self.vocab_size, self.what = grammar, vocab_size, what
        self._bits = torch.arange(32, dtype=torch.int32)
        # compiled once: start() copies it (a matcher per particle cost ~15 MB per state on a
        # 2000-branch anyOf schema, issue 12)
        self._fresh = self._matcher(grammar)
        self._probe()

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammars.grammar_of("regex", pattern), tokenizer, vocab_size, "regex")

    @classmethod
    def json_schema(cls, schema: str | dict, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammars.grammar_of("json_schema", schema), tokenizer, vocab_size, "JSON schema")

    @classmethod
    def lark(cls, text: str, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammars.grammar_of("grammar", text), tokenizer, vocab_size, "grammar")

    def start(self) -> Any:
        return self._fresh.deep_copy()

    def advance(self, state: Any, token: int) -> Any:
        state.consume_token(token)  # an invalid token puts the matcher in its error state
        return state

    def copy(self, state: Any) -> Any:
        return state.deep_copy()

    def allowed(self, state: Any) -> torch.Tensor:
        import llguidance.torch

        words = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V/32)]
        if not state.is_error():
            llguidance.torch.fill_next_token_bitmask(state, words, 0)
        else:
            words.zero_()
        bits = (words[0, :, None] >> self._bits) & 1  # [ceil(V/32), 32]
        return bits.flatten()[: self.vocab_size].bool()

    def log_end(self, state: Any) -> float:
        return 0.0 if not state.is_error() and state.is_accepting() else -math.inf

    def error(self, state: Any) -> str | None:
        if not state.is_error():
            return None
        return f"llguidance gave up on the {self.what}: {grammars.first_line(state.get_error())}"

    def _matcher(self, grammar: str) -> Any:
        import llguidance

        return llguidance.LLMatcher(
            self.tokenizer, grammar, log_level=0, limits=grammars.grammar_limits()
        )

    def _probe(self) -> None:
        """Refuse the grammar if llguidance gives up within the first tokens of one of its
        schemas' regexes, or of the grammar itself (a decode would die there). The regexes go
        first, so that the error names the culprit."""
        failure = None
        for pattern in grammars.patterns(self.grammar):
            reason = self._walk_regex(pattern)
            if reason is not None:
                shown = repr(pattern) if len(pattern) <= 80 else repr(pattern[:77]) + "..."
                failure = f"pattern {shown} is too complex, llguidance gives up on it ({reason})"
                break
        reason = None if failure is not None else self._walk(self._fresh.deep_copy())
        if reason is not None:
            failure = f"too complex, llguidance gives up at its first tokens ({reason})"
        if failure is not None:
            self._fresh = None
            release_heap()  # the lexer that gave up took tens of MB (measured: 30-65)
            raise ValueError(f"invalid {self.what}: {failure}")

    def _walk_regex(self, pattern: str) -> str | None:
        """`_walk` of a regex alone; None for one llguidance's regex syntax does not take (the
        schema compiled, so its JSON compiler took it)."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
        failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=grammars.grammar_limits()
        )
        return None if failed else self._walk(self._matcher(grammar))

    def _walk(self, matcher: Any) -> str | None:
        """Why llguidance gives up within `PROBE_TOKENS` tokens, each the lowest allowed id but
        EOS (the same walk for every request), or None."""
        eos = set(self.tokenizer.eos_tokens)
        for step in range(PROBE_TOKENS + 1):
            allowed = self.allowed(matcher)
            if matcher.is_error():
                return grammars.first_line(matcher.get_error())
            ids = [t for t in allowed.nonzero().flatten().tolist() if t not in eos]
            if not ids or step == PROBE_TOKENS:
                break
            matcher.consume_token(ids[0])
        return None


def release_heap() -> None:
    """glibc keeps freed memory in the arena of the thread that freed it until `malloc_trim`;
    without it a constrained request's matchers stay in the RSS. A no-op where the C library
    has no `malloc_trim` (musl, macOS)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols
    if trim is not None:
        trim(0)


class Product(Potential):
    def __init__(self, parts: Sequence[Potential]) -> None:
        flat: list[Potential] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, Product) else [p])
        if not flat:
            raise ValueError("a product of potentials needs at least one potential")
        self.parts = flat
        self.exponent = sum(p.exponent for p in flat)
        self.has_mask = any(p.has_mask for p in flat)
        self.has_value = any(p.has_value for p in flat)

    def start(self) -> tuple:
        return tuple(p.start() for p in self.parts)

    def advance(self, state: tuple, token: int) -> tuple:
        return tuple(p.advance(s, token) for p, s in zip(self.parts, state, strict=True))

    def copy(self, state: tuple) -> tuple:
        return tuple(p.copy(s) for p, s in zip(self.parts, state, strict=True))

    def allowed(self, state: tuple) -> torch.Tensor | None:
        mask = None
        for p, s in zip(self.parts, state, strict=True):
            m = p.allowed(s)
            if m is not None:
                mask = m if mask is None else mask & m
        return mask

    def log_value(self, tokens: list[int], final: bool) -> float:
        return sum(p.log_value(tokens, final) for p in self.parts if p.has_value)

    def log_end(self, state: tuple) -> float:
        return sum(p.log_end(s) for p, s in zip(self.parts, state, strict=True))

    def error(self, state: tuple) -> str | None:
        errors = (p.error(s) for p, s in zip(self.parts, state, strict=True))
        return next((e for e in errors if e is not None), None)
