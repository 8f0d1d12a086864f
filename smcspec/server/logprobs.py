"""Token log-probabilities in the OpenAI API's shapes: the chat endpoint's `content` entries
and the completions endpoint's parallel lists (led by the prompt's entries when it is echoed),
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

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
    to the text before it (see `_piece`)."""
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
    out = []
    for i, (token, value, top) in enumerate(zip(ids, lp.chosen, lp.top, strict=True)):
        context = before + ids[:i]
        alternatives = [(_piece(decode, context, alt), max(v, NO_LOGPROB)) for alt, v in top]
        if math.isnan(value):  # the prompt's first token: nothing came before it
            out.append((_piece(decode, context, token), None, None))
        else:
            out.append((_piece(decode, context, token), max(value, NO_LOGPROB), alternatives))
    return out


def _completion_view(entries: list[tuple]) -> dict[str, Any]:
    texts = [text for text, _, _ in entries]
    return {
        "tokens": texts,
        "token_logprobs": [value for _, value, _ in entries],
        "top_logprobs": [None if top is None else dict(top) for _, _, top in entries],
        "text_offset": [sum(len(t) for t in texts[:i]) for i in range(len(texts))],
    }


def _piece(decode: Callable[[list[int]], str], before: list[int], token: int) -> str:
    """The text `token` adds after `before` (decoded with a few tokens of context, so that a
    tokenizer's spaces and merges come out as in the whole text; a token that ends inside a
    multi-byte character adds nothing until the one that completes it)."""
    context = before[-6:]
    head, text = decode(context), decode([*context, token])
    return text[len(head) :] if text.startswith(head) else decode([token])


def _chat_entry(text: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    def entry(t: str, v: float) -> dict:
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}

    return {**entry(text, logprob), "top_logprobs": [entry(t, v) for t, v in top]}
