"""The interface every decoder uses to talk to a model.

A model is anything with a vocabulary size, a set of end-of-sequence ids, a way to make an empty
cache and a forward pass that appends tokens to that cache. Decoders never look inside a cache:
they only ask its batch size and length, pick rows (resampling, dropping finished particles),
crop it (speculative rollback) and release it when done. Every row of a cache holds the same
number of tokens.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from smcspec.kv.pages import PageAllocator


@runtime_checkable
class KVCache(Protocol):
    @property
    def batch_size(self) -> int:
        """Number of rows (sequences) held."""
        ...

    @property
    def length(self) -> int:
        """Tokens held per row."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep rows [B'] (int64, repeats allowed): new row i is old row rows[i]."""
        ...

    def crop(self, length: int) -> None:
        """Forget every position at or past `length`."""
        ...

    def release(self) -> None:
        """Give the cache's memory back; the cache is empty afterwards."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]
    context_length: int | None  # the longest sequence it takes, None when unknown

    def new_cache(self) -> KVCache:
        """An empty cache; it takes the batch size of its first forward."""
        ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, num_logits: int) -> torch.Tensor:
        """Append tokens [B, T] to every row of `cache` and return next-token logits for the last
        `num_logits` positions: [B, num_logits, V] (position t predicts the token after t)."""
        ...


@runtime_checkable
class PagedModel(CausalLM, Protocol):
    """A `CausalLM` whose caches draw pages from one shared pool (the native engine): the
    scheduler budgets admissions in its pages and batches requests through `forward_many`."""

    pages: PageAllocator  # the shared pool's allocator
    page_size: int  # positions per page
    context_length: int  # the longest sequence the model takes
    device: torch.device  # where its logits live

    def forward_many(self, calls: list[tuple[torch.Tensor, KVCache, int]]) -> list[torch.Tensor]:
        """`forward` for each (tokens [B_c, T_c], cache, num_logits_c) in one pass over the
        weights: [B_c, num_logits_c, V] each."""
        ...


def forward_many(
    model: CausalLM, calls: list[tuple[torch.Tensor, KVCache, int]]
) -> list[torch.Tensor]:
    """`model.forward` for each (tokens, cache, num_logits): in one batched pass for a
    `PagedModel`, else one call after another."""
    if isinstance(model, PagedModel):
        return model.forward_many(calls)
    return [model.forward(tokens, cache, n) for tokens, cache, n in calls]


def fresh_logits(model: CausalLM, ids: list[int], num_logits: int) -> torch.Tensor:
    """Next-token logits [num_logits, V] at the last `num_logits` positions of one pass of
    `model` over `ids` from an empty cache, whose pages go back to the pool however it ends."""
    cache = model.new_cache()
    try:
        return model.forward(torch.tensor([ids]), cache, num_logits)[0]
    finally:
        cache.release()
