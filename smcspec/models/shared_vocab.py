"""A pair whose embedding tables differ only in padding: Qwen2.5-7B's has 152,064 rows and
Qwen2.5-0.5B's 151,936, over one tokenizer of 151,665 tokens. Each model of such a pair is seen
through `SharedVocab`, its logits cut to the ids both tables hold, so that the draft's law and
the target's are over one vocabulary: the target's law is its own renormalized over those ids
(the rows past them, which no text the tokenizer makes can reach, get no mass), and sd and msd
are exact against that law."""

from __future__ import annotations

from typing import Any

import torch

from smcspec.models.base import CausalLM, KVCache


class SharedVocab:
    """`inner` with next-token logits over ids 0 .. width - 1 only; everything else is
    `inner`'s own (its cache, its pages, its `model`)."""

    def __init__(self, inner: CausalLM, width: int) -> None:
        if not 0 < width <= inner.vocab_size:
            raise ValueError(f"width must be in 1..{inner.vocab_size}, got {width}")
        self.inner = inner
        self.vocab_size = width

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, tokens: torch.Tensor, cache: KVCache, num_logits: int) -> torch.Tensor:
        """As `inner.forward`: [B, num_logits, width]."""
        return self.inner.forward(tokens, cache, num_logits)[..., : self.vocab_size]

    def forward_many(self, calls: list[tuple[torch.Tensor, KVCache, int]]) -> list[torch.Tensor]:
        """As `inner.forward_many`, each [B_c, num_logits_c, width]."""
        return [x[..., : self.vocab_size] for x in self.inner.forward_many(calls)]


def shared(target: CausalLM, draft: CausalLM, tokens: int | None) -> tuple[CausalLM, CausalLM]:
    """The pair as it decodes: as it is where both tables have as many rows; else each model cut
    to the smaller table, which must hold every id of the tokenizer (`tokens` of them; None:
    no tokenizer, ids are the caller's)."""
    if target.vocab_size == draft.vocab_size:
        return target, draft
    width = min(target.vocab_size, draft.vocab_size)
    if tokens is not None and tokens > width:
        raise ValueError(
            f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size} "
            f"rows) by more than padding: the tokenizer has {tokens} tokens, more than the "
            f"smaller table's {width}; the draft must share the target's tokenizer"
        )
    return (
        target if target.vocab_size == width else SharedVocab(target, width),
        draft if draft.vocab_size == width else SharedVocab(draft, width),
    )
