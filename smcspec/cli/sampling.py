"""`smcspec generate`'s sampling flags: one per `SamplingConfig` field, named after it, so that a
new field needs only its flag, and the settings they give."""

from __future__ import annotations

import argparse
from typing import Any

from smcspec.config import SAMPLING_FIELDS, SamplingConfig


def add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    _add_sampling(gen)
    _add_penalties(gen)
    _add_logprobs(gen)


def _add_sampling(gen: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field, named after it (stop_at_eos: --ignore-eos); --stop."""
    gen.add_argument(
        "--temperature",
        type=float,
        default=SamplingConfig.temperature,
        help="target temperature (0 = greedy)",
    )
    gen.add_argument(
        "--draft-temperature",
        type=float,
        default=None,
        help="the draft's proposal temperature (default: --temperature)",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=SamplingConfig.top_k,
        help="keep the K likeliest tokens; 0: all",
    )
    gen.add_argument(
        "--top-p", type=float, default=SamplingConfig.top_p, help="nucleus mass; 1: all"
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=SamplingConfig.max_new_tokens,
        help="new tokens at most",
    )
    gen.add_argument(
        "--min-p",
        type=float,
        default=SamplingConfig.min_p,
        help="drop tokens below this fraction of the likeliest one's probability; 0: none",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="reproduces a run exactly (default: a random one, shown in the summary)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STRING",
        help="end the text before this string (repeatable)",
    )


def _add_penalties(gen: argparse.ArgumentParser) -> None:
    """The sampling adjustments that read the sequence's own tokens, and logit_bias."""
    gen.add_argument(
        "--repetition-penalty",
        type=float,
        default=SamplingConfig.repetition_penalty,
        help="divide the positive logits of tokens already in the prompt or text; 1: none",
    )
    gen.add_argument(
        "--presence-penalty",
        type=float,
        default=SamplingConfig.presence_penalty,
        help="subtract from the logit of every token the text holds, in [-2, 2]",
    )
    gen.add_argument(
        "--frequency-penalty",
        type=float,
        default=SamplingConfig.frequency_penalty,
        help="subtract, per occurrence in the text, from a token's logit, in [-2, 2]",
    )
    gen.add_argument(
        "--logit-bias",
        type=_bias_pair,
        action="append",
        default=list(SamplingConfig.logit_bias),
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )


def _add_logprobs(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--logprobs",
        type=int,
        default=SamplingConfig.logprobs,
        metavar="TOP",
        help="with --json: each token's log-probability and the TOP likeliest (0: none)",
    )
    gen.add_argument(
        "--prompt-logprobs",
        type=int,
        default=SamplingConfig.prompt_logprobs,
        metavar="TOP",
        help="with --json: the same for the prompt's tokens (one more pass over the prompt)",
    )


def _bias_pair(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, e.g. 13=-100, got {text!r}") from None


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every `SamplingConfig` field from the flag of the same name (--ignore-eos for
    stop_at_eos), so that a new field needs only its flag."""
    names = [name for name in SAMPLING_FIELDS if name != "stop_at_eos"]
    return {"stop_at_eos": not args.ignore_eos} | {name: getattr(args, name) for name in names}
