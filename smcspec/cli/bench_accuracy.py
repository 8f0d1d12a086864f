"""`smcspec bench accuracy`: its options and the run (`bench.accuracy`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from smcspec.bench.tasks import TASKS
from smcspec.cli.bench_grid import T_DEFAULT, add_grid_options, grid_from_args, precision
from smcspec.cli.common import command, llm_from_args


def add_accuracy(bsub) -> None:
    acc = command(bsub, "accuracy", "pass@1 with 95% CI, paired against ar, and speed")
    add_grid_options(acc, ["ar", "sd", "smc"], "4")
    add_task_options(acc, "data fetched on first use")
    acc.add_argument(
        "--problems",
        default=None,
        help="a slice of the task's problems, START:END (END excluded), e.g. 0:200; "
        "overrides --offset and --limit",
    )
    acc.add_argument("--offset", type=int, default=0, help="first problem")
    acc.add_argument("--limit", type=int, default=20, help="number of problems")
    acc.add_argument(
        "--held-out",
        action="store_true",
        help="allow the held-out problems (HumanEval 100-163, GSM8K 1000-, MATH-500 400-), "
        "kept for checking claims",
    )
    acc.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="new tokens per problem (default: the task's: 384, MATH-500 512)",
    )
    acc.add_argument("--timeout", type=float, default=10.0, help="seconds per check")
    acc.add_argument(
        "--batch",
        type=int,
        default=1,
        help="problems decoded at once, sharing batched passes (each decodes as it would "
        "alone, with its own seed; tok/s is then per problem under that load)",
    )


def add_task_options(p: argparse.ArgumentParser, about: str) -> None:
    """--task (`about` it ends its help) and --temperature, as every task-driven bench has."""
    p.add_argument(
        "--task",
        choices=list(TASKS),
        default="humaneval",
        help=f"humaneval, gsm8k, math500 (needs smcspec[eval]) or mbpp; {about}",
    )
    p.add_argument("--temperature", type=float, default=T_DEFAULT, help="sampling temperature")


def problem_slice(text: str | None, offset: int, limit: int) -> tuple[int, int]:
    """(offset, limit) from --problems START:END, else as given."""
    if text is None:
        return offset, limit
    start, sep, end = text.partition(":")
    try:
        first, stop = int(start), int(end)
    except ValueError:
        first = stop = -1
    if not sep or first < 0 or stop <= first:
        raise ValueError(f"--problems must be START:END with 0 <= START < END, got {text!r}")
    return first, stop - first


def run_accuracy_args(args: argparse.Namespace) -> int:
    from smcspec.bench.accuracy import AccuracyPlan, run_accuracy

    offset, limit = problem_slice(args.problems, args.offset, args.limit)
    plan = AccuracyPlan(
        grid_from_args(args),
        args.temperature,
        offset,
        limit,
        args.max_new_tokens,
        args.timeout,
        args.seed,
        args.task,
        args.held_out,
        args.batch,
    )
    TASKS[plan.task].load(args.cache_dir)  # fetched and checked before any model loads
    llm = llm_from_args(args, None)
    run_accuracy(llm, plan, args.out, precision(llm), args.cache_dir)
    print((Path(args.out) / "accuracy.md").read_text())
    return 0
