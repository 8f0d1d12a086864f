"""`smcspec bench law`: its options and the run (`bench.law`)."""

from __future__ import annotations

import argparse

from smcspec.bench.tasks import TASKS
from smcspec.cli.bench_accuracy import add_task_options, problem_slice
from smcspec.cli.bench_grid import add_grid_options, grid_from_args, precision
from smcspec.cli.common import command, llm_from_args


def add_law(bsub) -> None:
    law = command(
        bsub, "law", "do a method's texts follow the target's law? (each token scored afresh)"
    )
    add_grid_options(law, ["ar", "sd"], "2")
    add_task_options(law, "its prompts as bench accuracy's, never the held-out ones")
    law.add_argument("--problems", default="0:32", help="a slice of the task's prompts, START:END")
    law.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per text")
    law.add_argument(
        "--batch", type=int, default=1, help="prompts decoded at once, sharing batched passes"
    )


def run_law_args(args: argparse.Namespace) -> int:
    from smcspec.bench.law import LawPlan, check_folder, run_law

    offset, limit = problem_slice(args.problems, 0, 0)
    plan = LawPlan(
        grid_from_args(args),
        args.temperature,
        offset,
        limit,
        args.max_new_tokens,
        args.seed,
        args.task,
        args.batch,
    )
    check_folder(plan, args.out)
    TASKS[plan.task].load(args.cache_dir)  # fetched and checked before any model loads
    llm = llm_from_args(args, None)
    print(run_law(llm, plan, args.out, precision(llm), args.cache_dir))
    return 0
