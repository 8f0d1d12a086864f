"""What `LLM.generate` returns: the text, its tokens and the decode's diagnostics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from smcspec.decoding.base import Stats
from smcspec.decoding.logprobs import TokenLogprobs


@dataclass
class GenerationResult:
    """The text (cut before the first stop string) and its tokens (up to the one that completed
    the stop string). `finish_reason` is "stop" (EOS or a stop string) or "length" (the
    max_new_tokens limit). diagnostics["new_tokens"] counts every token decoded. `stats` is the
    method's own figures, typed (`ARStats`, `SDStats`, `SMCStats`); `diagnostics` holds them
    serialised beside the common ones (time, tokens, rounds, seed), as JSON shows them."""

    text: str
    token_ids: list[int]
    method: str
    finish_reason: str
    diagnostics: dict[str, Any] = field(default_factory=dict)
    particle_texts: list[str] | None = None
    stats: Stats | None = None
    logprobs: TokenLogprobs | None = None  # one entry per token of token_ids, when asked for
    prompt_logprobs: TokenLogprobs | None = None  # per prompt token (the first's is NaN)

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "token_ids": self.token_ids, "method": self.method}
        out["finish_reason"] = self.finish_reason
        out.update(self.diagnostics)
        if self.particle_texts is not None:
            out["particle_texts"] = self.particle_texts
        for key, scores in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if scores is not None:
                out[key] = {
                    "token_logprobs": [None if math.isnan(v) else v for v in scores.chosen],
                    "top_logprobs": [[list(pair) for pair in top] for top in scores.top],
                }
        return out
