"""Token log-probabilities in the OpenAI API's shapes: the chat endpoint's `content` entries
and the completions endpoint's parallel lists (led by the prompt's entries when it is echoed),
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from smcspec.engine import GenerationResult

# What an impossible token's log-probability (-inf, which JSON cannot hold) is reported as, as
# vLLM does.
NO_LOGPROB = -9999.0


def logprobs_view(
    decode: Callable[[list[int]], str],
    result: GenerationResult,
    chat: bool,
    echoed: list[int] | None = None,
) -> dict[str, Any] | None:
    """The result's token log-probabilities in the endpoint's OpenAI shape (None if not asked):
    chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, or the completions API's
    `{tokens, token_logprobs, top_logprobs, text_offset}`, led by the prompt's tokens when
    they are `echoed` (the first with null log-probability). A token's text is what it adds
    to the text before it (see `_pieces`)."""
    if result.logprobs is None:
        return None
    if chat:
        return {"content": [_chat_entry(*e) for e in _entries(decode, [], result)]}
    entries = _entries(decode, [], result)
    if echoed is not None and result.prompt_logprobs is not None:
        prompt = GenerationResult("", echoed, "", "", logprobs=result.prompt_logprobs)
        entries = _entries(decode, [], prompt) + _entries(decode, echoed, result)
    return _completion_view(entries)


def prompt_logprobs_view(decode: Callable[[list[int]], str], ids: list[int], result):
    """The prompt's log-probabilities (vLLM's prompt_logprobs), in the completions shape."""
    if result.prompt_logprobs is None:
        return None
    prompt = GenerationResult("", ids, "", "", logprobs=result.prompt_logprobs)
    return _completion_view(_entries(decode, [], prompt))


def _entries(decode, before: list[int], result: GenerationResult) -> list[tuple]:
    """(text, log-probability or None, [(text, log-probability)] or None) per token of the
    result, each token's text taken after `before` and the tokens before it."""
    ids, lp = result.token_ids, result.logprobs
    full = before + ids
    out = []
    for i, (token, value, top) in enumerate(zip(ids, lp.chosen, lp.top, strict=True)):
        if math.isnan(value):  # the prompt's first token: nothing came before it
            out.append((_pieces(decode, full[: len(before) + i], [token])[0], None, None))
            continue
        texts = _pieces(decode, full[: len(before) + i], [token] + [alt for alt, _ in top])
        alternatives = [(t, max(v, NO_LOGPROB)) for t, (_, v) in zip(texts[1:], top, strict=True)]
        out.append((texts[0], max(value, NO_LOGPROB), alternatives))
    return out


def _completion_view(entries: list[tuple]) -> dict[str, Any]:
    texts = [text for text, _, _ in entries]
    return {
        "tokens": texts,
        "token_logprobs": [value for _, value, _ in entries],
        "top_logprobs": [None if top is None else dict(top) for _, _, top in entries],
        # each token starts where the text before it ends
        "text_offset": [
            end - len(t)
            for t, end in zip(texts, itertools.accumulate(map(len, texts)), strict=True)
        ],
    }


def _pieces(decode: Callable[[list[int]], str], before: list[int], tokens: list[int]) -> list[str]:
    """The text each of `tokens` would add after `before` (decoded with a few tokens of
    context, decoded once, so that a tokenizer's spaces and merges come out as in the whole
    text; a token that ends inside a multi-byte character adds nothing until the one that
    completes it)."""
    context = before[-6:]
    head = decode(context)
    out = []
    for token in tokens:
        text = decode([*context, token])
        out.append(text[len(head) :] if text.startswith(head) else decode([token]))
    return out


def _chat_entry(text: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    def entry(t: str, v: float) -> dict:
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}

    return {**entry(text, logprob), "top_logprobs": [entry(t, v) for t, v in top]}
