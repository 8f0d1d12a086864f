"""What every `smcspec bench` command that runs a grid of methods shares: its options, the grid
they make (checked before any model loads), and how a result header names the weights."""

from __future__ import annotations

import argparse

from smcspec.bench.contenders import LLAMA_CPP, METHOD_NAMES, build_grid, parse_ints
from smcspec.cli.common import add_model_options, add_resample_threshold
from smcspec.config import SamplingConfig, SMCConfig

T_DEFAULT = SamplingConfig.temperature


def add_grid_options(p: argparse.ArgumentParser, methods: list[str], smc_n: str) -> None:
    p.add_argument(
        "--methods",
        nargs="+",
        default=methods,
        help=f"of {' '.join(m for m in METHOD_NAMES if m not in LLAMA_CPP)}: -block verifies "
        "blocks, sd-lookup drafts by prompt lookup, -lookup-draft by lookup where it matches "
        "(else the draft model), auto-approx is auto with --approximate (it may pick smc), hf "
        "peers need --backend hf; bench speed also takes llama-cpp llama-cpp-spec "
        "(./scripts/build_llama_cpp builds llama.cpp)",
    )
    p.add_argument("--sd-k", default="2,4", help="K grid for sd")
    p.add_argument("--smc-n", default=smc_n, help="N grid for smc")
    p.add_argument("--smc-k", default="2,4", help="K grid for smc")
    p.add_argument("--msd-n", default="2,4", help="N grid for msd")
    p.add_argument("--msd-k", default=None, help="K grid for msd (default: --sd-k's)")
    p.add_argument(
        "--smc-power", default="", help="also run each smc setting with Power(alpha), e.g. 2,4"
    )
    add_resample_threshold(p, SMCConfig.resample_threshold)
    p.add_argument("--out", default="bench-results", help="folder for .jsonl, .md and .png files")
    p.add_argument("--seed", type=int, default=0, help="seed of the first run")
    add_model_options(p)


def floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise ValueError(f"{name} must be a comma-separated list of numbers, got {text!r}") from err
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def grid_from_args(args: argparse.Namespace):
    if args.backend != "hf" and {"hf", "hf-assisted"} & set(args.methods):
        raise ValueError("hf and hf-assisted need --backend hf (they run transformers' generate)")
    speed = args.bench_command == "speed"
    if not speed and set(LLAMA_CPP) & set(args.methods):
        raise ValueError("llama-cpp and llama-cpp-spec run in bench speed only")
    draft_temps = getattr(args, "draft_temperatures", "")
    return build_grid(
        args.methods,
        parse_ints(args.sd_k, "--sd-k"),
        parse_ints(args.smc_n, "--smc-n"),
        parse_ints(args.smc_k, "--smc-k"),
        args.resample_threshold,
        floats(args.smc_power, "--smc-power") if args.smc_power else None,
        [q.strip() for q in args.quants.split(",") if q.strip()] if speed else None,
        [None, *floats(draft_temps, "--draft-temperatures")] if draft_temps else None,
        parse_ints(args.msd_n, "--msd-n"),
        parse_ints(args.msd_k, "--msd-k") if args.msd_k is not None else None,
    )


def precision(llm) -> str:
    """How the weights ran, for result headers: e.g. "int8, native backend"."""
    return f"{llm.dtype}, {llm.backend} backend"
