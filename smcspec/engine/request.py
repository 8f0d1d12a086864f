"""A checked generation request, and the potentials a request can ask for.

A `Request` carries typed settings: the decoding config (`ARConfig`, `SDConfig` or `SMCConfig`,
whose type picks the decoder), the sampling config, an optional potential, the resolved seed and
the stop strings. `LLM.plan` is its only constructor; the keywords of `generate`, the CLI's
flags and an HTTP body become its configs through one converter,
`decoding.methods.configs_from_fields`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from smcspec.config import DecodingConfig, SamplingConfig, SettingError
from smcspec.decoding import methods
from smcspec.potentials import Constraint, Potential, Power, Product, Reward


class TextModel(Protocol):
    """What potentials over text need of a model (an `LLM`): its tokenizer (None when prompts
    are token ids), vocabulary size, the decoding of ids to text, and llguidance's view of the
    tokenizer."""

    tokenizer: Any

    @property
    def vocab_size(self) -> int: ...

    def decode_text(self, ids: list[int]) -> str: ...

    def guidance_tokenizer(self) -> Any: ...


@dataclass(frozen=True)
class Request:
    """One checked generation request: the prompt's token ids and every decoding setting."""

    prompt_ids: list[int]
    decoding: DecodingConfig
    sampling: SamplingConfig
    potential: Potential | None
    seed: int
    stops: tuple[str, ...] = ()

    @property
    def method(self) -> str:
        return methods.method_of(self.decoding)

    def kv_rows(self) -> tuple[int, int]:
        """Sequences this request keeps in the target's and the draft's KV cache."""
        return methods.kv_rows(self.decoding)

    def max_length(self) -> int:
        """The longest a sequence can get: prompt, new tokens, and a round of drafts past them."""
        lookahead = methods.lookahead(self.decoding)
        return len(self.prompt_ids) + self.sampling.max_new_tokens + lookahead

    def check_context(self, context: int | None) -> None:
        """A SettingError naming max_new_tokens where the request needs more positions than a
        model's context (None: unknown) holds."""
        need = self.max_length()
        if context is None or need <= context:
            return
        lookahead = need - len(self.prompt_ids) - self.sampling.max_new_tokens
        drafts = f" and {lookahead} draft tokens of lookahead" if lookahead else ""
        raise SettingError(
            f"max_new_tokens: the prompt's {len(self.prompt_ids)} tokens, "
            f"{self.sampling.max_new_tokens} new tokens{drafts} need {need} positions; the "
            f"model's context holds {context}",
            "max_new_tokens",
        )


# `generate`'s keywords that `build_potential` reads (the rest are settings)
POTENTIAL_KEYWORDS = (
    "power_alpha",
    "regex",
    "json_schema",
    "grammar",
    "reward",
    "reward_beta",
    "reward_every",
    "potential",
)


def build_potential(
    llm: TextModel,
    power_alpha: float | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    grammar: str | None = None,
    reward: Callable[[str], float] | None = None,
    reward_beta: float = 1.0,
    reward_every: int | None = None,
    potential: Potential | None = None,
) -> Potential | None:
    """The product of the potentials asked for, or None: power, one constraint (a regex, a JSON
    schema or a Lark grammar, compiled against `llm`'s tokenizer), a reward of the decoded text,
    and any potential object (`potential`)."""
    parts: list[Potential] = []
    if power_alpha is not None:
        parts.append(Power(power_alpha))
    texts = {"regex": regex, "json_schema": json_schema, "grammar": grammar}
    if sum(v is not None for v in texts.values()) > 1:
        raise ValueError("give at most one of regex, json_schema and grammar")
    for kind, text in texts.items():
        if text is None:
            continue
        if llm.tokenizer is None:
            raise ValueError(f"{kind} needs a tokenizer (this LLM has none)")
        build = {"regex": Constraint.regex, "json_schema": Constraint.json_schema}
        make = build.get(kind, Constraint.lark)
        parts.append(make(text, llm.guidance_tokenizer(), llm.vocab_size))
    if reward is not None:
        if not callable(reward):
            raise ValueError(f"reward must be a function of the text, got {reward!r}")
        decode = llm.decode_text
        parts.append(Reward(lambda ids, final: reward(decode(ids)), reward_beta, reward_every))
    if potential is not None:
        parts.append(potential)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Product(parts)
