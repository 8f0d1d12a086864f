"""The reference next-token law, written out from its definitions one token at a time in float64
(plain Python: `math`, sorted lists), and the exact laws the decoding tests compare against.

It never imports `smcspec.sampling`: the exactness tests judge the decoders, and `sampling.law`
with them, against this; an oracle that called the code it judges would agree with any bug in it
(dropping min-p from `law` once passed every exactness case). tests/test_sampling_fields.py holds
the two to each other on random logits.

The law (as `smcspec.sampling` documents it, in Hugging Face's order): the logits adjusted for
the context (logit_bias added; repetition penalty r on every token of the prompt and text, l / r
where l > 0, l * r elsewhere; minus frequency * c + presence * [c > 0], c counting the generated
tokens only), then softmax(l / T), then top-k, top-p and min-p, each on the law the step before
left, renormalized. T = 0 puts all mass on the first arg-max. Logits are finite; -inf is a token
of probability 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from smcspec.config import SamplingConfig

NEG_INF = float("-inf")


class LogitsModel(Protocol):
    """What the walk needs of a toy model (`smcspec.models.toy.ToyLM`)."""

    vocab_size: int
    eos_token_ids: frozenset[int]

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor: ...  # [V]


def adjusted(
    logits: Sequence[float], context: Sequence[int], prompt_len: int, cfg: SamplingConfig
) -> list[float]:
    """The logits of the position after `context` (the prompt's prompt_len tokens, then text)."""
    bias = dict(cfg.logit_bias)
    seen = set(context)
    generated = list(context[prompt_len:])
    r = cfg.repetition_penalty
    out = []
    for token, value in enumerate(logits):
        value = float(value) + bias.get(token, 0.0)
        if token in seen and r != 1:
            value = value / r if value > 0 else value * r
        count = generated.count(token)
        value -= cfg.frequency_penalty * count + cfg.presence_penalty * (count > 0)
        out.append(value)
    return out


def normalized(scores: Sequence[float]) -> list[float]:
    """log softmax: scores minus their log-sum-exp; -inf stays -inf."""
    top = max(scores)
    log_z = top + math.log(math.fsum(math.exp(s - top) for s in scores))
    return [s - log_z for s in scores]


def tempered(logits: Sequence[float], temperature: float) -> list[float]:
    """log softmax(l / T); T = 0: log of the point mass on the first arg-max."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda i: logits[i])  # max keeps the first of ties
        return [0.0 if i == best else NEG_INF for i in range(len(logits))]
    return normalized([v / temperature for v in logits])


def descending(logp: Sequence[float]) -> list[int]:
    """Token ids from the likeliest down; ties by id (sorted is stable)."""
    return sorted(range(len(logp)), key=lambda i: -logp[i])


def keep(logp: Sequence[float], kept: set[int]) -> list[float]:
    """The law restricted to `kept`, renormalized."""
    return normalized([v if i in kept else NEG_INF for i, v in enumerate(logp)])


def top_k(logp: Sequence[float], k: int) -> list[float]:
    """The k likeliest tokens, exactly k even under ties (the lowest ids among tied ones)."""
    if not 0 < k < len(logp):
        return list(logp)
    return keep(logp, set(descending(logp)[:k]))


def top_p(logp: Sequence[float], p: float) -> list[float]:
    """From the likeliest down, a token stays while the mass strictly before it is < p; the
    first always stays."""
    if p >= 1.0:
        return list(logp)
    kept, before = set(), 0.0
    for rank, token in enumerate(descending(logp)):
        if rank > 0 and before >= p:
            break
        kept.add(token)
        before += math.exp(logp[token])
    return keep(logp, kept)


def min_p(logp: Sequence[float], fraction: float) -> list[float]:
    """The tokens of probability >= fraction * the largest."""
    if fraction <= 0.0:
        return list(logp)
    probs = [math.exp(v) for v in logp]
    floor = fraction * max(probs)
    return keep(logp, {i for i, q in enumerate(probs) if q >= floor})


def next_token_law(
    logits: Sequence[float],
    context: Sequence[int],
    prompt_len: int,
    cfg: SamplingConfig,
    temperature: float | None = None,
) -> list[float]:
    """log p'(x | context) for every token x: the whole law of the module docstring.
    temperature None: cfg's."""
    temp = cfg.temperature if temperature is None else temperature
    logp = tempered(adjusted(logits, context, prompt_len, cfg), temp)
    if temp == 0:
        return logp
    return min_p(top_p(top_k(logp, cfg.top_k), cfg.top_p), cfg.min_p)


def position_law(
    model: LogitsModel,
    context: Sequence[int],
    prompt_len: int,
    cfg: SamplingConfig,
    temperature: float | None = None,
) -> list[float]:
    """`next_token_law` at the toy model's own logits after `context`."""
    logits = model.logits(tuple(context)).double().tolist()
    return next_token_law(logits, context, prompt_len, cfg, temperature)


def sequence_law(
    model: LogitsModel,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    temperature: float | None = None,
) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation (ending at EOS when cfg stops there, or at
    max_new_tokens): the product of its tokens' next-token laws."""
    law: dict[tuple[int, ...], float] = {}
    for seq, logp in _walk(model, tuple(prompt), (), 0.0, cfg, temperature):
        law[seq] = law.get(seq, 0.0) + math.exp(logp)
    return law


def _walk(
    model: LogitsModel,
    prompt: tuple[int, ...],
    generated: tuple[int, ...],
    logp_so_far: float,
    cfg: SamplingConfig,
    temperature: float | None,
) -> Iterator[tuple[tuple[int, ...], float]]:
    ended = cfg.stop_at_eos and generated and generated[-1] in model.eos_token_ids
    if len(generated) == cfg.max_new_tokens or ended:
        yield generated, logp_so_far
        return
    logp = position_law(model, prompt + generated, len(prompt), cfg, temperature)
    for token, value in enumerate(logp):
        if value > NEG_INF:
            yield from _walk(
                model, prompt, (*generated, token), logp_so_far + value, cfg, temperature
            )


def token_scores(
    model: LogitsModel,
    prompt: Sequence[int],
    tokens: Sequence[int],
    cfg: SamplingConfig,
    top: int,
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """For each generated token x_t: log p'(x_t | prompt, x_<t), and the law's `top` likeliest
    (id, log-probability) pairs there, likeliest first."""
    chosen, alternatives = [], []
    for t, token in enumerate(tokens):
        logp = position_law(model, [*prompt, *tokens[:t]], len(prompt), cfg)
        chosen.append(logp[token])
        alternatives.append([(i, logp[i]) for i in descending(logp)[:top]])
    return chosen, alternatives
