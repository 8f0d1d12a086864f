"""Log-probabilities of the returned tokens, as the OpenAI API and vLLM report them.

For every returned token x_t: log p'(x_t | x_<t), where p' is the target's next-token law the
decoders sample (`sampling.law`: after logit bias, penalties, temperature, top-k, top-p and
min-p), and the `top` likeliest tokens of that law with theirs. A potential is not included: it
defines a law over whole sequences, which smc reports through its weights and log Z-hat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from smcspec import sampling

if TYPE_CHECKING:
    from smcspec.config import SamplingConfig
    from smcspec.models.base import CausalLM


@dataclass
class TokenLogprobs:
    """Per returned token, in order: its log-probability and the `top` alternatives as
    (token id, log-probability) pairs, likeliest first (empty lists when top is 0)."""

    chosen: list[float]
    top: list[list[tuple[int, float]]]

    def __len__(self) -> int:
        return len(self.chosen)

    def cut(self, n: int) -> TokenLogprobs:
        """The first n tokens' (the text's tokens, when a stop string ended it early)."""
        return TokenLogprobs(self.chosen[:n], self.top[:n])

    @staticmethod
    def join(parts: list[TokenLogprobs]) -> TokenLogprobs:
        return TokenLogprobs(
            [x for p in parts for x in p.chosen], [x for p in parts for x in p.top]
        )


def score(
    logp: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(token) [...], and the top ids [..., top] and log-probs [..., top] of each row of
    logp [..., V], on logp's device (no host sync)."""
    chosen = sampling.pick(logp, tokens)
    values, ids = logp.topk(top, dim=-1) if top > 0 else (logp[..., :0], tokens[..., None][..., :0])
    return chosen, ids, values


def to_host(chosen: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> TokenLogprobs:
    """`score`'s tensors for one sequence ([T], [T, top], [T, top]) as a TokenLogprobs."""
    ids_l, values_l = ids.cpu().tolist(), values.cpu().tolist()
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids_l, values_l, strict=True)]
    return TokenLogprobs(chosen.cpu().tolist(), top)


def score_prompt(
    model: CausalLM, prompt: list[int], cfg: SamplingConfig, top: int
) -> TokenLogprobs:
    """Every prompt token after the first under the target's law given the tokens before it
    (one forward pass over the prompt); the first has none (NaN, and no alternatives)."""
    if len(prompt) < 2:
        return TokenLogprobs([math.nan], [[]])
    ids = torch.tensor([prompt])
    cache = model.new_cache()
    try:
        logits = model.forward(ids, cache, len(prompt))[:, :-1]  # [1, L - 1, V]
    finally:
        cache.release()
    # position j follows prompt[: j + 1]; nothing of it counts as generated text
    law = sampling.law(logits, cfg, cfg.temperature, [ids[:, :-1]], len(prompt))[0]
    scored = to_host(*score(law, ids[0, 1:].to(law.device), top))
    return TokenLogprobs([math.nan, *scored.chosen], [[], *scored.top])


class ParticleLogprobs:
    """Every particle's token log-probabilities [N, max_new] and top alternatives
    [N, max_new, top], kept beside `Population.tokens` and reordered with it."""

    def __init__(self, n: int, max_new: int, top: int) -> None:
        self.chosen = torch.zeros(n, max_new, dtype=torch.float64)
        self.ids = torch.zeros(n, max_new, top, dtype=torch.long)
        self.values = torch.zeros(n, max_new, top, dtype=torch.float64)

    def write(self, rows: torch.Tensor, start: int, scored: tuple[torch.Tensor, ...]) -> None:
        """`score`'s tensors for a block [B, w] of the particles `rows` [B] from position
        `start`."""
        chosen, ids, values = (t.cpu() for t in scored)
        w = chosen.shape[1]
        self.chosen[rows, start : start + w] = chosen.double()
        self.ids[rows, start : start + w] = ids
        self.values[rows, start : start + w] = values.double()

    def reorder(self, ancestors: torch.Tensor) -> None:
        self.chosen, self.ids, self.values = (
            self.chosen[ancestors],
            self.ids[ancestors],
            self.values[ancestors],
        )

    def of(self, i: int, length: int) -> TokenLogprobs:
        return to_host(self.chosen[i, :length], self.ids[i, :length], self.values[i, :length])
