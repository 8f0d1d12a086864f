"""`smcspec generate PROMPT`: its flags, the potentials they ask for, the run, and the summary
line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from smcspec.cli.common import (
    K_HELP,
    add_auto,
    add_engine_limits,
    add_method_settings,
    add_model_options,
    command,
    engine_limits,
    llm_from_args,
)
from smcspec.cli.sampling import add_sampling_flags, sampling_settings
from smcspec.config import MAX_PARTICLES
from smcspec.engine import (
    configs_from_fields,
    method_fields,
    method_names,
    method_row,
    setting_label,
)

METHOD_HELP = (
    "decoding method (default: auto, the fastest exact setting for the request, or smc's "
    "fastest with a potential)"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = command(sub, "generate", "generate text from a prompt")
    gen.add_argument(
        "prompt", help="the prompt (a user message unless --no-chat); - reads standard input"
    )
    gen.add_argument("--method", choices=method_names(), default=None, help=METHOD_HELP)
    n_help = f"particles N (smc, msd); more than {MAX_PARTICLES} need --allow-large"
    add_method_settings(gen, n_help, K_HELP, allow_large=True)
    add_auto(gen)
    add_sampling_flags(gen)
    add_model_options(gen)
    add_engine_limits(gen)
    _add_potentials(gen)
    gen.add_argument(
        "--system", default=None, metavar="TEXT", help="a system message before the prompt"
    )
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")


def _add_potentials(gen: argparse.ArgumentParser) -> None:
    pot = gen.add_argument_group("potentials (smc samples p(x) phi(x); ar applies them locally)")
    pot.add_argument("--power-alpha", type=float, default=None, help="target p(x)^alpha")
    pot.add_argument("--regex", default=None, help="the output must fully match this regex")
    pot.add_argument("--json-schema", default=None, metavar="FILE", help="JSON schema file")
    pot.add_argument("--grammar", default=None, metavar="FILE", help="Lark grammar file")
    pot.add_argument("--reward", default=None, metavar="MODULE:FUNCTION", help="r(text) -> float")
    pot.add_argument("--reward-beta", type=float, default=1.0, help="weight exp(beta r)")
    pot.add_argument(
        "--reward-every", type=int, default=None, help="also score prefixes every M tokens"
    )


def run_generate(args: argparse.Namespace) -> int:
    from smcspec.engine.text import check_stops

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("prompt is empty")
    if args.system is not None and args.no_chat:
        raise ValueError("--system goes into the chat template, which --no-chat turns off")
    # Every setting is checked, and typed, before a minute of model loading.
    potentials = _potential_args(args)
    decoding, sampling = configs_from_fields(settings(args))
    check_stops(args.stop)
    llm = llm_from_args(args, limits=engine_limits(args))
    if args.system is not None:
        prompt = _with_system(llm, args.system, prompt)
    potential = llm.build_potential(
        **potentials, reward_beta=args.reward_beta, reward_every=args.reward_every
    )
    request = llm.plan(prompt, decoding, sampling, potential, stop=args.stop, chat=not args.no_chat)
    result = llm.run(request)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(summary(result), file=sys.stderr)
    return 0


def _with_system(llm, system: str, prompt: str) -> list[int]:
    """The token ids of a system message and the prompt through the chat template."""
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--system needs a model with a chat template")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return llm.encode_messages(messages)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags `configs_from_fields` reads, each named as its field: the method, every
    method's settings and every `SamplingConfig` field, so that a new field needs only its
    flag."""
    names = ("method", "allow_large", "approximate", *method_fields())
    return {name: getattr(args, name) for name in names} | sampling_settings(args)


def _potential_args(args: argparse.Namespace) -> dict:
    """The potentials asked for (`build_potential`'s keywords, read and checked: a constraint
    compiles) before any model loads; empty when none is."""
    from smcspec.grammars import grammar_of
    from smcspec.potentials import Power, Reward

    out: dict = {}
    if args.power_alpha is not None:
        Power(args.power_alpha)
        out["power_alpha"] = args.power_alpha
    if args.regex is not None:
        out["regex"] = args.regex
    for key in ("json_schema", "grammar"):
        path = getattr(args, key)
        if path is not None:
            try:
                out[key] = Path(path).read_text()
            except OSError as err:
                raise ValueError(f"--{key.replace('_', '-')}: cannot read {path}: {err}") from err
    for key in ("regex", "json_schema", "grammar"):
        if key in out:
            grammar_of(key, out[key])
    if args.reward is not None:
        out["reward"] = load_function(args.reward)
        Reward(out["reward"], args.reward_beta, args.reward_every)  # checks beta and every
    if args.method is not None and out and not method_row(args.method).potentials:
        raise ValueError(
            f"{args.method} cannot take potentials (it samples p exactly); use --method smc"
        )
    return out


def load_function(spec: str):
    """`module:function` -> the function, or a ValueError that says what is missing."""
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--reward must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--reward: cannot import {module_name}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward: {module_name} has no function {name}")
    return fn


def summary(result) -> str:
    """One line for stderr: speed, time split, the method's own figures, finish and seed."""
    from smcspec.engine import MSDStats, SDStats, SMCStats

    d, stats = result.diagnostics, result.stats
    split = d["time_split"]
    parts = [
        f"[{result.method}] {d['new_tokens']} tokens in {d['seconds']:.2f} s"
        f" = {d['tokens_per_second']:.2f} tok/s",
        f"rounds {d['rounds']}",
        "time prefill/draft/verify/resample/other "
        + "/".join(f"{split[k]:.2f}" for k in ("prefill", "draft", "verify", "resample", "other"))
        + " s",
    ]
    if isinstance(stats, SDStats) and stats.acceptance_rate is not None:  # None: no draft
        parts.append(
            f"acceptance {stats.acceptance_rate:.2f}, "
            f"accepted/round {stats.mean_accepted_length:.2f}"
        )
    if isinstance(stats, MSDStats) and stats.proposed_tokens:  # none: nothing drafted
        depths = "/".join("-" if a is None else f"{a:.2f}" for a in stats.acceptance_by_depth)
        parts.append(
            f"accepted/round {stats.mean_accepted_length:.2f}, acceptance by depth {depths}"
        )
    if isinstance(stats, SMCStats):
        ess = stats.ess
        mean_ess = sum(ess) / len(ess) if ess else float("nan")
        parts.append(
            f"N {len(stats.weights)}, mean ESS {mean_ess:.2f}, resamples {stats.resamples}, "
            f"log Z-hat {stats.log_z_hat:.3f}"
        )
        if stats.valid_particles is not None:
            parts.append(f"valid particles {stats.valid_particles}")
            if stats.valid_particles == 0:
                parts.append(
                    "WARNING: no particle satisfied the potentials; raise --particles or "
                    "--max-new-tokens"
                )
    if getattr(stats, "settings", None):  # auto's choices
        parts.append("auto chose " + ", then ".join(_setting(s) for s in stats.settings))
    parts.append(f"finish {result.finish_reason}")
    parts.append(f"seed {d['seed']}")
    return " | ".join(parts)


def _setting(chosen: dict[str, Any]) -> str:
    """One of auto's settings: "sd K=4 for 12 rounds (predicted 14.1, measured 13.2 tok/s)"."""
    measured = chosen["measured_tokens_per_second"]
    return (
        f"{setting_label(chosen)} for {chosen['rounds']} rounds (predicted "
        f"{chosen['predicted_tokens_per_second']:.1f}, measured "
        f"{'-' if measured is None else f'{measured:.1f}'} tok/s)"
    )
