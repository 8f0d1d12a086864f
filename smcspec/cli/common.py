"""What the command lines share (`smcspec generate`, `smcspec serve` and `smcspec bench`): the
help format, the model options, the LLM they name, and the method flags. All import this; none
imports another's internals."""

from __future__ import annotations

import argparse
from dataclasses import fields

from smcspec.config import (
    DEFAULT_KV_PAGES,
    MAX_PARTICLES,
    MSD_DRAFT_TOKENS,
    PROPOSALS,
    RESAMPLING_SCHEMES,
    SD_DRAFT_TOKENS,
    SD_VERIFY,
    SMC_DRAFT_TOKENS,
    SMC_PARTICLES,
    VERIFY_RULES,
    EngineLimits,
    HTTPLimits,
    SMCConfig,
)
from smcspec.engine import BACKENDS, DTYPES

K_HELP = (
    f"draft tokens K per round (default: {SD_DRAFT_TOKENS} for sd, {SMC_DRAFT_TOKENS} for smc, "
    f"{MSD_DRAFT_TOKENS} for msd)"
)


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it; flags are off
    unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        skip = not action.option_strings or isinstance(action.default, bool)
        if skip or action.default == argparse.SUPPRESS or "default" in text:
            return text
        value = action.default
        if isinstance(value, list):
            value = " ".join(value)
        value = "none" if value in (None, "") else value
        return f"{text} (default: {str(value).replace('%', '%%')})".lstrip()


def command(sub, name: str, help: str) -> argparse.ArgumentParser:
    # argparse %-formats a help string, not a description
    escaped = help.replace("%", "%%")
    return sub.add_parser(name, help=escaped, description=help, formatter_class=Help)


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="hub id, folder or .gguf (default: built-in)")
    p.add_argument("--draft", default=None, help="hub id, folder or .gguf (default: built-in)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights; auto = int8 on a CPU (float activations), bfloat16 on CUDA; int4: CPU",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when there is one, else cpu), cpu, cuda or cuda:<index>",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="native engine on CUDA: run every step eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native: the Llama family (Llama, Qwen2/3, Mistral, Phi-3, Gemma 3, SmolLM3, OLMo 2) "
        "on a paged KV cache; hf: transformers (any model); auto: native where it applies",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SMCSPEC_CACHE or ~/.cache/smcspec)",
    )


def llm_kwargs(
    args: argparse.Namespace, backend: str | None = None, limits: EngineLimits | None = None
) -> dict:
    """`LLM`'s arguments from the model options (`add_model_options`) and `limits` (None: the
    engine's defaults); `backend` overrides --backend."""
    return {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "device": args.device,
        "cache_dir": args.cache_dir,
        "backend": args.backend if backend is None else backend,
        "enforce_eager": args.enforce_eager,
        "limits": limits,
    }


def llm_from_args(
    args: argparse.Namespace, backend: str | None = None, limits: EngineLimits | None = None
):
    """The LLM the model options (`add_model_options`) name, within `limits`; `backend`
    overrides --backend."""
    from smcspec.engine import LLM

    return LLM(**llm_kwargs(args, backend, limits))


# The flags of `EngineLimits`' fields (page_size keeps its default: no flag).
ENGINE_FLAGS = ("max_running", "max_batch_tokens", "kv_pages", "kv_memory")


def add_engine_limits(p: argparse.ArgumentParser) -> None:
    """The flags of one `EngineLimits` (`engine_limits`), defaults read from it."""
    limits = EngineLimits()
    group = p.add_argument_group(
        "engine limits",
        "--max-running and --max-batch-tokens bound the scheduler that batches concurrent "
        "requests (serve's); generate decodes its one request alone",
    )
    group.add_argument(
        "--max-running",
        type=int,
        default=limits.max_running,
        help="requests decoded at once; others queue",
    )
    group.add_argument(
        "--max-batch-tokens",
        type=int,
        default=limits.max_batch_tokens,
        help="tokens per forward pass; longer prompts are prefilled in pieces",
    )
    pool = group.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-pages",
        type=int,
        default=limits.kv_pages,
        metavar="N",
        help=f"native engine: pages of {limits.page_size} positions in each model's KV pool "
        f"(default: {DEFAULT_KV_PAGES})",
    )
    pool.add_argument(
        "--kv-memory",
        type=float,
        default=limits.kv_memory,
        metavar="FRACTION",
        help="native engine: size the KV pools to this share of the memory free once the "
        "weights are loaded (the GPU's, or the RAM on a CPU), as vLLM's "
        "--gpu-memory-utilization (default: none; the pools hold --kv-pages)",
    )


def engine_limits(args: argparse.Namespace) -> EngineLimits:
    """The `EngineLimits` of `add_engine_limits`' flags, checked before any model loads."""
    return _limits(EngineLimits, args, ENGINE_FLAGS)


def http_limits(args: argparse.Namespace) -> HTTPLimits:
    """The `HTTPLimits` of the flags named after its fields, checked."""
    return _limits(HTTPLimits, args, tuple(f.name for f in fields(HTTPLimits)))


def _limits(cls: type, args: argparse.Namespace, names: tuple[str, ...]):
    """`cls` from the flags `names`; its error, which starts with the field, names the flag."""
    try:
        return cls(**{name: getattr(args, name) for name in names})
    except ValueError as err:
        name = next((n for n in names if str(err).startswith(n)), None)
        if name is None:
            raise
        raise ValueError(f"--{name.replace('_', '-')}: {err}") from None


def add_resample_threshold(p: argparse.ArgumentParser, default: float | None = None) -> None:
    """None: not given (smc's own default), so a method that does not read it refuses none."""
    p.add_argument(
        "--resample-threshold",
        type=float,
        default=default,
        help="smc: resample when ESS < this x N (ESS >= 1: at N = 2 only above 0.5 "
        f"resamples; default {SMCConfig.resample_threshold})",
    )


def add_method_settings(
    p: argparse.ArgumentParser, particles: str, draft_tokens: str, allow_large: bool
) -> None:
    """The methods' own settings, generate's and serve's alike: N and K (each command says what
    they are for), --allow-large where `allow_large`, sd's rule and proposal, smc's
    resampling. None: not given (each method's own default)."""
    # No -n: it means choices in OpenAI's API and tokens in llama.cpp.
    p.add_argument(
        "--particles",
        type=int,
        default=None,
        metavar="N",
        help=f"{particles} (default: {SMC_PARTICLES})",
    )
    if allow_large:
        p.add_argument(
            "--allow-large", action="store_true", help=f"allow more than {MAX_PARTICLES} particles"
        )
    p.add_argument("-k", "--draft-tokens", type=int, default=None, help=draft_tokens)
    _add_sd_options(p)
    _add_resampling(p)


def add_auto(p: argparse.ArgumentParser) -> None:
    """auto's settings (`AutoConfig`): --approximate and the bounds of what it weighs."""
    auto = p.add_argument_group("auto (the default method: the fastest setting, chosen as it runs)")
    auto.add_argument(
        "--approximate",
        action="store_true",
        default=None,
        help="let auto choose smc too (approximate), while its chi^2 / N <= --max-divergence",
    )
    auto.add_argument("--max-particles", type=int, default=None, metavar="N", help="auto's most N")
    auto.add_argument(
        "--max-draft-tokens", type=int, default=None, metavar="K", help="auto's most K"
    )
    auto.add_argument(
        "--redecide-every", type=int, default=None, metavar="R", help="auto chooses every R rounds"
    )
    auto.add_argument(
        "--max-divergence",
        type=float,
        default=None,
        help="with --approximate: the most chi^2 / N smc's weights may show (default 0.03)",
    )
    p.set_defaults(exact=None)  # no flag of its own: --approximate is its opposite


def _add_sd_options(p: argparse.ArgumentParser) -> None:
    """sd's own settings (`SDConfig`): the verification rule and the proposal; None: not given
    (sd's own default)."""
    p.add_argument(
        "--verify",
        choices=VERIFY_RULES,
        default=None,
        help="sd, msd: test the drafts token by token, or the block jointly (sd: keeps at least "
        f"as many; msd: block-verifies one draft at a time; default {SD_VERIFY})",
    )
    p.add_argument(
        "--proposal",
        choices=PROPOSALS,
        default=None,
        help="sd: drafts from the draft model, from the text itself (prompt lookup: the tokens "
        "that followed its last n-gram before), or lookup where it matches, else the draft; "
        "msd: the draft model, or (either lookup) the lookup as its first draft (default draft)",
    )
    p.add_argument(
        "--lookup-ngram",
        type=int,
        default=None,
        metavar="N",
        help="sd's and msd's lookup: the longest n-gram matched, then shorter ones (default 3)",
    )


def _add_resampling(p: argparse.ArgumentParser) -> None:
    add_resample_threshold(p)
    p.add_argument(
        "--resampling",
        choices=RESAMPLING_SCHEMES,
        default=None,
        help=f"smc's scheme (default {SMCConfig.resampling})",
    )
