"""Potentials: factors phi(x) on whole sequences, so that SMC samples  p(x) phi(x) / Z.

A potential speaks through up to four hooks, each optional:
- `exponent` e: phi contains p(x)^e, the target's own probability (Power(alpha): e = alpha - 1);
- `allowed(state)`: a bool mask [V] of next tokens that keep x completable (a hard constraint);
- `log_value(tokens, final)`: the log of a sequence-level factor as a function of the prefix (a
  reward, or a twisted reward on prefixes); the sampler evaluates it after every round and at the
  end and adds the change since the last evaluation, so intermediate values telescope away and
  the target is exactly p(x) exp(log_value(x, final=True));
- `log_end(state)`: a last factor on a sequence cut at max_new_tokens (0 or -inf for constraints).
Per-particle state: `start()`, `advance(state, token)`, `copy(state)` (resampling duplicates).
Potentials combine by product (`Product`, or `a * b`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch


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
    """

    has_mask = True

    def __init__(
        self, grammar: str, tokenizer: Any, vocab_size: int, what: str = "grammar"
    ) -> None:
        import llguidance

        if isinstance(tokenizer, llguidance.LLTokenizer):
            self.tokenizer = tokenizer
        else:
            import llguidance.hf

            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        _validate(grammar, self.tokenizer, what)
        self.grammar, self.vocab_size = grammar, vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)
        self._fresh: Any = None  # a matcher at the start, compiled once: start() copies it

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammar_of("regex", pattern), tokenizer, vocab_size, "regex")

    @classmethod
    def json_schema(cls, schema: str | dict, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammar_of("json_schema", schema), tokenizer, vocab_size, "JSON schema")

    @classmethod
    def lark(cls, text: str, tokenizer: Any, vocab_size: int) -> Constraint:
        return cls(grammar_of("grammar", text), tokenizer, vocab_size, "grammar")

    def start(self) -> Any:
        """A fresh matcher. Copies share the compiled grammar: compiling per particle cost
        ~15 MB per state on a 2000-branch anyOf schema (issue 12)."""
        import llguidance

        if self._fresh is None:
            self._fresh = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
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


_KINDS = {"regex": "regex", "json_schema": "JSON schema", "grammar": "grammar"}


def grammar_of(kind: str, text: str | dict) -> str:
    """The llguidance grammar of a `regex`, a `json_schema` (JSON text or a dict) or a Lark
    `grammar`, compiled and checked without a tokenizer, so a malformed one fails before any
    model loads."""
    import json

    import llguidance

    if kind not in _KINDS:
        raise ValueError(f"constraint kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    what = _KINDS[kind]
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            schema = json.loads(text) if isinstance(text, str) else text
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as err:
        raise ValueError(f"invalid {what}: {_one_line(str(err))}") from err
    _validate(grammar, None, what)
    return grammar


def _validate(grammar: str, tokenizer: Any, what: str) -> None:
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        message = _one_line(messages[0]) if messages else "rejected"
        if what == "regex":  # the position is in llguidance's wrapper grammar, not the regex
            message = re.sub(r"^at \d+\(\d+\): ", "", message)
        raise ValueError(f"invalid {what}: {message}")


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt: the first line and any "error:" line,
    so the CLI can print it as one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "rejected"
    causes = [
        line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")
    ]
    return " ".join([lines[0], *causes])


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
