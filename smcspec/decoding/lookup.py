"""Prompt lookup: drafts taken from the text itself, not from a draft model.

Where the output copies its input (an edited function, a summary quoting its source, JSON echoing
a request), the tokens after the text's last n tokens often already stand earlier in the prompt
or the output. `continuation` finds the latest earlier place where the last n tokens occur,
longest n first, and proposes the K tokens that followed it there.

As a proposal this is a point mass: q(x) = 1 at the looked-up token, 0 elsewhere, given the text
so far (the drafts after the first are the lookup's too, a function of the same text). sd's
rules stay exact with it (keep x with probability p(x); the residual max(0, p - q) is p without
x), and a draft costs no model step. smc cannot use it: its weights p / q need a proposal whose
support covers the target's, and a point mass leaves every other token at weight zero, so
particles would all be copies of one text whose weight says nothing about p.
"""

from __future__ import annotations

import torch

# the longest n-gram matched (then n - 1, ... down to 1): llama.cpp's and vLLM's defaults are 3-4
LOOKUP_NGRAM = 3


def continuation(tokens: list[int], k: int, ngram: int = LOOKUP_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the text's last n tokens,
    for n = ngram down to 1; [] where none of them occurs earlier (or k is 0)."""
    size = len(tokens)
    for n in range(min(ngram, size - 1), 0, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest first: the nearest context
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def point_masses(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """log q of a point mass at each token: [len(tokens), V], 0 at the token, -inf elsewhere."""
    logq = torch.full((len(tokens), vocab_size), float("-inf"))
    if tokens:
        logq[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logq
