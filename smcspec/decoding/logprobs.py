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
from smcspec.models.base import fresh_logits

if TYPE_CHECKING:
    from smcspec.config import SamplingConfig
    from smcspec.models.base import CausalLM, KVCache


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
    chosen, ids, values = sampling.to_host(chosen, ids, values)  # one wait, if on the device
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprobs(chosen.tolist(), top)


SCORE_BYTES = 64 * 2**20
"""The float32 logits prompt scoring holds at once: `score_chunk` positions a forward pass, 1,024
at a 16k vocabulary and 110 at Qwen's 152k (one pass over a 4,000-token prompt would hold 262 MB
and 2.4 GB of them, and the law makes a few copies)."""


def score_chunk(model: CausalLM) -> int:
    """Positions `score_prompt` feeds a forward pass: as many as keep their logits [C, V] within
    SCORE_BYTES, and no more than one pass of the scheduler carries when `model` is its view
    (`pass_tokens`), so a scored prompt runs through chunked prefill like any other prompt."""
    chunk = max(1, SCORE_BYTES // (4 * model.vocab_size))
    return min(chunk, getattr(model, "pass_tokens", chunk))


def score_prompt(
    model: CausalLM, prompt: list[int], cfg: SamplingConfig, top: int, chunk: int | None = None
) -> TokenLogprobs:
    """Every prompt token after the first under the target's law given the tokens before it;
    the first has none (NaN, and no alternatives). The prompt is fed `chunk` positions a pass
    (default `score_chunk`), each block scored before the next is asked for, so at most
    chunk x V logits live at once whatever the prompt's length. The same numbers as
    `score_prompt_whole` up to the model's rounding over a different split of the positions
    (bit-identical where logits depend only on the prefix, as a toy model's)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if len(prompt) < 2:
        return TokenLogprobs([math.nan], [[]])
    chunk = score_chunk(model) if chunk is None else chunk
    ids = torch.tensor([prompt])  # [1, L]
    parts = [TokenLogprobs([math.nan], [[]])]
    cache = model.new_cache()
    try:
        # the last token predicts nothing in the prompt: positions 0 .. L - 2 are fed
        for start in range(0, len(prompt) - 1, chunk):
            end = min(start + chunk, len(prompt) - 1)
            parts.append(_score_fed(model, cache, ids, start, end, cfg, top))
    finally:
        cache.release()
    return TokenLogprobs.join(parts)


def score_prompt_whole(
    model: CausalLM, prompt: list[int], cfg: SamplingConfig, top: int
) -> TokenLogprobs:
    """`score_prompt` in one forward pass over the prompt, [L - 1, V] logits at once: the
    reference the chunked path is tested against."""
    if len(prompt) < 2:
        return TokenLogprobs([math.nan], [[]])
    logits = fresh_logits(model, prompt[:-1], len(prompt) - 1)[None]  # [1, L - 1, V]
    block = _score_block(logits, torch.tensor([prompt]), 0, cfg, top)
    return TokenLogprobs.join([TokenLogprobs([math.nan], [[]]), block])


def _score_fed(
    model: CausalLM,
    cache: KVCache,
    ids: torch.Tensor,
    start: int,
    end: int,
    cfg: SamplingConfig,
    top: int,
) -> TokenLogprobs:
    """Positions start .. end - 1 fed to `cache` (which holds the ones before) and scored. A
    function of its own so that its logits are freed before the next block's pass."""
    logits = model.forward(ids[:, start:end], cache, end - start)  # [1, P, V]
    return _score_block(logits, ids, start, cfg, top)


def _score_block(
    logits: torch.Tensor, ids: torch.Tensor, start: int, cfg: SamplingConfig, top: int
) -> TokenLogprobs:
    """Prompt tokens start + 1 .. start + P scored by the logits [1, P, V] of the positions
    before them; ids [1, L] is the whole prompt."""
    end = start + logits.shape[1]
    # position j follows prompt[: j + 1]; nothing of the prompt counts as generated text
    law = sampling.law(logits, cfg, cfg.temperature, [ids[:, :end]], ids.shape[1])[0]  # [P, V]
    return to_host(*score(law, sampling.to_device(ids[0, start + 1 : end + 1], law.device), top))


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
        chosen, ids, values = sampling.to_host(*scored)  # (the decoder read them back)
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
