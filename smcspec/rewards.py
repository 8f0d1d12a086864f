"""Rewards for `generate(reward=...)`: functions from the generated text to a number.

`doctest_reward(problem)`: for a HumanEval-style problem, the fraction of the `>>>` examples in
its docstring that the code in the reply passes. The code runs in a separate Python process with
a time limit (a reply that loops or crashes scores 0 and cannot hurt the sampler).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable

CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
EXAMPLE = re.compile(r"^\s*>>> (.+)\n\s*([^\n>][^\n]*)$", re.MULTILINE)

_HARNESS = """
import json, sys
passed = 0
for expr, expected in json.loads(sys.argv[1]):
    try:
        passed += bool(eval(expr) == eval(expected))
    except Exception:
        pass
print(passed)
"""


def extract_code(text: str, entry_point: str) -> str:
    """The function the model wrote: the first fenced block that defines `entry_point`, else the
    first fenced block, else the whole reply."""
    blocks = CODE_BLOCK.findall(text)
    for block in blocks:
        if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", block):
            return block
    return blocks[0] if blocks else text


def doctest_examples(prompt: str) -> list[tuple[str, str]]:
    """(expression, expected output) pairs of the `>>>` lines in a prompt."""
    return [(expr.strip(), expected.strip()) for expr, expected in EXAMPLE.findall(prompt)]


def doctest_reward(problem: dict, timeout: float = 5.0) -> Callable[[str], float]:
    """r(text) = passed / total over the problem's visible examples (0 without examples)."""
    examples = doctest_examples(problem["prompt"])
    header = "\n".join(
        line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from "))
    )

    def reward(text: str) -> float:
        if not examples:
            return 0.0
        code = extract_code(text, problem["entry_point"])
        program = f"{header}\n{code}\n{_HARNESS}"
        try:
            done = subprocess.run(
                [sys.executable, "-c", program, json.dumps(examples)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            passed = int(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            return 0.0  # a loop, a crash before the harness ran, or no output: nothing passed
        return passed / len(examples)

    return reward
