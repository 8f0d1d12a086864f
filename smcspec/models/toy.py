"""Tiny in-memory language models whose whole-sequence law can be enumerated exactly.

`ToyLM` turns any function  prefix -> logits [V]  into a `CausalLM`. `random_lm` gives every prefix
its own reproducible random logits (so the law depends on the whole context), and `perturbed_lm`
derives a draft from a target by adding prefix-keyed noise: the larger the noise, the farther q is
from p. The exact law of a continuation is enumerated in the tests (tests/oracle.py), from the
definitions rather than from `sampling`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

LogitsFn = Callable[[tuple[int, ...]], torch.Tensor]


class ToyCache:
    """Per-row token prefixes: the exact analogue of a KV cache for a table model."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = [()]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return len(self.rows[0])

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]

    def crop(self, length: int) -> None:
        self.rows = [row[:length] for row in self.rows]

    def release(self) -> None:
        self.rows = [()]


class ToyLM:
    """A `CausalLM` defined by a function from a token prefix to next-token logits [V]."""

    def __init__(self, logits_fn: LogitsFn, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length: int | None = None
        self._logits_fn = logits_fn
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}
        self._windows: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}
        self.batch_sizes: list[int] = []  # rows of every forward call, for cost accounting

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._memo:
            self._memo[prefix] = self._logits_fn(prefix)
        return self._memo[prefix]

    def _window(self, prefixes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        # [P, V]: the exactness tests run the same few windows 20,000 times; one stack each
        if prefixes not in self._windows:
            self._windows[prefixes] = torch.stack([self.logits(p) for p in prefixes])
        return self._windows[prefixes]

    def new_cache(self) -> ToyCache:
        return ToyCache()

    def forward(self, tokens: torch.Tensor, cache: ToyCache, num_logits: int) -> torch.Tensor:
        self.batch_sizes.append(tokens.shape[0])
        if cache.length == 0:  # an empty cache takes the batch size of its first forward
            cache.rows = [()] * tokens.shape[0]
        out = []
        new_rows = []
        for row, new in zip(cache.rows, tokens.tolist(), strict=True):
            prefixes = [row + tuple(new[: t + 1]) for t in range(len(new))]
            out.append(self._window(tuple(prefixes[-num_logits:])))
            new_rows.append(prefixes[-1])
        cache.rows = new_rows
        return torch.stack(out)


def _prefix_generator(seed: int, prefix: tuple[int, ...]) -> torch.Generator:
    key = zlib.crc32(repr((seed, prefix)).encode())
    return torch.Generator().manual_seed(key)


def random_lm(vocab_size: int, seed: int, scale: float = 1.5, eos_id: int = 0) -> ToyLM:
    """Every prefix gets logits scale * N(0, I), reproducibly keyed on (seed, prefix)."""

    def logits_fn(prefix: tuple[int, ...]) -> torch.Tensor:
        g = _prefix_generator(seed, prefix)
        return scale * torch.randn(vocab_size, generator=g, dtype=torch.float64).float()

    return ToyLM(logits_fn, vocab_size, {eos_id})


def perturbed_lm(base: ToyLM, seed: int, noise: float) -> ToyLM:
    """logits_q(prefix) = logits_p(prefix) + noise * N(0, I): a draft at a chosen distance."""

    def logits_fn(prefix: tuple[int, ...]) -> torch.Tensor:
        g = _prefix_generator(seed, prefix)
        eps = torch.randn(base.vocab_size, generator=g, dtype=torch.float64).float()
        return base.logits(prefix) + noise * eps

    return ToyLM(logits_fn, base.vocab_size, set(base.eos_token_ids))
