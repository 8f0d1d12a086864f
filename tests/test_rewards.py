"""The HumanEval doctest reward: examples parsed from the prompt, code run apart with a limit."""

from smcspec.bench.prompts import humaneval_problems
from smcspec.rewards import doctest_examples, doctest_reward

PROBLEM = humaneval_problems(0, 1)[0]  # has_close_elements, two >>> examples

RIGHT = """Here it is:
```python
def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
```"""
HALF = """```python
def has_close_elements(numbers, threshold):
    return False
```"""
LOOPS = """```python
def has_close_elements(numbers, threshold):
    while True:
        pass
```"""


def test_examples_are_parsed_from_the_docstring():
    assert doctest_examples(PROBLEM["prompt"]) == [
        ("has_close_elements([1.0, 2.0, 3.0], 0.5)", "False"),
        ("has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)", "True"),
    ]


def test_reward_is_the_fraction_of_examples_passed():
    reward = doctest_reward(PROBLEM, timeout=2.0)
    assert reward(RIGHT) == 1.0
    assert reward(HALF) == 0.5  # right on the False example only
    assert reward("no code at all") == 0.0
    assert reward(LOOPS) == 0.0  # killed at the time limit


def test_a_problem_without_examples_scores_zero():
    assert doctest_reward({"prompt": "def f():\n    pass\n", "entry_point": "f"})("x") == 0.0


ROWS = {
    "prompt": '''def rows(n: int) -> str:
    r"""Rows 0 .. n-1 of a triangle of numbers, one per line.
    >>> print(rows(3))
    0
    0 1
    0 1 2
    >>> grid = [
    ...     rows(1),
    ...     rows(2),
    ... ]
    >>> grid
    ['0', '0\\n0 1']
    >>> rows(1) == "0"
    """
''',
    "entry_point": "rows",
}
ROWS_RIGHT = """```python
def rows(n):
    return "\\n".join(" ".join(str(j) for j in range(i + 1)) for i in range(n))
```"""
ROWS_UP_TO_TWO = """```python
def rows(n):
    return ["0", "0\\n0 1", "0\\n0 1\\n0 1"][n - 1]
```"""


def test_multi_line_outputs_and_continuation_lines_are_scored_right():
    assert doctest_examples(ROWS["prompt"]) == [
        ("print(rows(3))", "0\n0 1\n0 1 2"),
        ("grid = [\n    rows(1),\n    rows(2),\n]", ""),  # a continued statement, no check
        ("grid", "['0', '0\\n0 1']"),
        ('rows(1) == "0"', "True"),  # a comparison without output is a check that it holds
    ]
    reward = doctest_reward(ROWS, timeout=5.0)
    assert reward(ROWS_RIGHT) == 1.0
    assert reward(ROWS_UP_TO_TWO) == 2 / 3  # its third row is wrong: the print check fails


def test_outputs_that_differ_only_in_spacing_pass():
    problem = {"prompt": 'def pair():\n    """\n    >>> pair()\n    (1,2)\n    """\n'}
    problem["entry_point"] = "pair"
    assert doctest_reward(problem)("def pair():\n    return (1, 2)\n") == 1.0


def harmful(body: str) -> str:
    return (
        f"```python\ndef f():\n    import os, shutil, subprocess\n    {body}\n    return True\n```"
    )


def test_a_reply_that_does_harm_scores_zero_and_harms_nothing(tmp_path):
    victim, folder, marker = tmp_path / "victim.txt", tmp_path / "folder", tmp_path / "marker"
    victim.write_text("keep me")
    folder.mkdir()
    (folder / "inside.txt").write_text("keep me too")
    problem = {"prompt": 'def f():\n    """\n    >>> f()\n    True\n    """\n', "entry_point": "f"}
    reward = doctest_reward(problem, timeout=5.0)
    assert reward(harmful("pass")) == 1.0  # the harness itself works
    for body in (
        f"os.remove({str(victim)!r})",
        f"shutil.rmtree({str(folder)!r})",
        f"os.system('touch {marker}')",
        f"subprocess.run(['touch', {str(marker)!r}])",
        f"open({str(victim)!r}, 'w').write('x')",  # outside the scratch folder
        "open('big', 'w').write('x' * (2 << 20))",  # in it, but past the file size limit
        "x = bytearray(2 << 30)",  # 2 GiB: past the memory limit
    ):
        assert reward(harmful(body)) == 0.0, body
    assert victim.read_text() == "keep me"
    assert (folder / "inside.txt").read_text() == "keep me too"
    assert not marker.exists()


def test_the_reply_runs_under_memory_and_cpu_limits():
    probe = """```python
def f():
    import resource
    memory = resource.getrlimit(resource.RLIMIT_AS)[0]
    cpu = resource.getrlimit(resource.RLIMIT_CPU)[0]
    return 0 < memory <= 1 << 30 and 0 < cpu <= 10
```"""
    problem = {"prompt": 'def f():\n    """\n    >>> f()\n    True\n    """\n', "entry_point": "f"}
    assert doctest_reward(problem, timeout=5.0)(probe) == 1.0
