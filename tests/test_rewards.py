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
