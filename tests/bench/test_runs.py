"""The benchmark drivers end to end on toy models (no download), and their input checks."""

import dataclasses

import pytest

from smcspec import LLM
from smcspec.bench import accuracy
from smcspec.bench.contenders import build_grid, parse_ints
from smcspec.bench.results import measurements
from smcspec.bench.speed import SpeedPlan, run_speed
from smcspec.bench.tasks import TASKS
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.rewards import extract_code


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
    assert extract_code(reply, "f").startswith("import math")
    two = "```python\nprint(1)\n```\n```python\ndef g():\n    pass\n```"
    assert extract_code(two, "g").startswith("def g")
    assert extract_code("def h(): pass", "h") == "def h(): pass"
    unterminated = "```python\ndef f(x):\n    return x\n"
    assert "return x" in extract_code(unterminated, "f")


def test_the_harness_passes_a_correct_reply_and_fails_a_wrong_one():
    humaneval = TASKS["humaneval"]
    problem = humaneval.problems(0, 1)[0]
    good = "```python\n" + problem["prompt"] + problem["canonical_solution"] + "```"
    bad = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert humaneval.check(problem, good, 10.0).passed
    assert not humaneval.check(problem, bad, 10.0).passed


def test_accuracy_run_on_toy_models_resumes_and_pairs_with_ar(llm, tmp_path):
    grid = build_grid(["ar", "smc"], [2], [2], [2])
    plan = accuracy.AccuracyPlan(grid, limit=2, max_new_tokens=4, timeout=5.0)
    rows = accuracy.run_accuracy(llm, plan, tmp_path)
    records = measurements(tmp_path / "accuracy.jsonl")
    assert len(records) == 4 and {r["task_id"] for r in records} == {"HumanEval/0", "HumanEval/1"}
    assert all(r["passed"] is False for r in records)  # random words are not code
    assert all(r["mean_target_logp"] < 0 for r in records)
    assert [r["label"] for r in rows] == ["ar", "smc N=2 K=2"]
    assert rows[1]["paired"] == 2 and rows[1]["mcnemar_p"] == 1.0
    assert (tmp_path / "pareto.png").exists()
    text = (tmp_path / "accuracy.md").read_text()
    assert text.startswith("HumanEval pass@1: problems 0..1")
    assert "target ToyLM, draft ToyLM" in text
    # a rerun of a longer slice runs only the problem it has not run
    longer = dataclasses.replace(plan, limit=3)
    accuracy.run_accuracy(llm, longer, tmp_path)
    again = measurements(tmp_path / "accuracy.jsonl")
    assert len(again) == 6 and again[:4] == records


def test_a_batched_accuracy_run_gives_each_problem_its_lone_decode(llm, tmp_path):
    """Five problems two at a time (two batches, then one alone): each with the seed and the
    tokens it gets run by itself. The second batch starts at problem 2, so its seeds must
    start at seed + 2, not at the first batch's seed."""
    grid = build_grid(["ar", "sd"], [2], [2], [2])
    plan = accuracy.AccuracyPlan(grid, limit=5, max_new_tokens=6, seed=5)
    accuracy.run_accuracy(llm, plan, tmp_path / "alone")
    accuracy.run_accuracy(llm, dataclasses.replace(plan, batch=2), tmp_path / "batched")
    alone = {r["key"]: r for r in measurements(tmp_path / "alone" / "accuracy.jsonl")}
    batched = {r["key"]: r for r in measurements(tmp_path / "batched" / "accuracy.jsonl")}
    assert alone.keys() == batched.keys() and len(alone) == 10
    assert all(batched[k]["completion"] == alone[k]["completion"] for k in alone)
    assert {r["batch"] for r in batched.values()} == {2}
    text = (tmp_path / "batched" / "accuracy.md").read_text()
    assert "2 problems decoded at once" in text
    with pytest.raises(ValueError, match="batch must be"):
        dataclasses.replace(plan, batch=0)


def test_a_math_task_runs_on_toy_models(llm, tmp_path):
    grid = build_grid(["ar"], [2], [2], [2])
    plan = accuracy.AccuracyPlan(grid, limit=2, max_new_tokens=4, task="gsm8k", seed=3)
    accuracy.run_accuracy(llm, plan, tmp_path)
    records = measurements(tmp_path / "accuracy.jsonl")
    assert [r["task_id"] for r in records] == ["gsm8k/0", "gsm8k/1"]
    assert all(r["task"] == "gsm8k" and r["key"].endswith("|seed=3") for r in records)
    assert (tmp_path / "accuracy.md").read_text().startswith("GSM8K pass@1: problems 0..1")


def test_accuracy_plan_checks_its_slice():
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match="offset"):
        accuracy.AccuracyPlan(grid, offset=164)
    with pytest.raises(ValueError, match="limit"):
        accuracy.AccuracyPlan(grid, limit=0)
    with pytest.raises(ValueError, match="held out"):
        accuracy.AccuracyPlan(grid, offset=90, limit=20)
    with pytest.raises(ValueError, match="unknown task"):
        accuracy.AccuracyPlan(grid, task="mmlu")


def test_msd_and_auto_contenders_expand_and_are_checked_before_loading():
    grid = build_grid(
        ["ar", "msd", "auto", "auto-approx"], [3, 4], [2], [2], [], None, None, [None, 2.0], [2]
    )
    assert [c.label for c in grid] == [
        "ar",
        "msd N=2 K=3",
        "msd N=2 K=3 draft T=2",
        "msd N=2 K=4",
        "msd N=2 K=4 draft T=2",
        "auto",
        "auto draft T=2",
        "auto approx",
        "auto approx draft T=2",
    ]  # msd's K: sd's grid when none is given
    assert grid[7].settings == {"approximate": True}
    assert [c.label for c in build_grid(["msd"], [4], [2], [2], msd_n=[2, 4], msd_k=[8])] == [
        "msd N=2 K=8",
        "msd N=4 K=8",
    ]
    with pytest.raises(ValueError, match=r"particles \(N\)"):
        build_grid(["msd"], [4], [2], [2], msd_n=[0])
    with pytest.raises(ValueError, match=r"particles .* <= 64"):
        build_grid(["msd"], [4], [2], [2], msd_n=[65])


@pytest.mark.parametrize(
    "argv, message",
    [(["--msd-n", "0"], "particles (N)"), (["--msd-k", "2,x"], "--msd-k must be")],
)
def test_bench_speed_refuses_a_bad_msd_grid_in_one_line(argv, message, tmp_path, capsys):
    from smcspec import cli

    argv = ["bench", "speed", "--methods", "msd", *argv, "--cache-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "models").exists()


NK = (("N", "particles"), ("K", "draft_tokens"))


def test_speed_profiles_auto_before_timing_and_tables_its_choices(llm, tmp_path, monkeypatch):
    from smcspec.bench import speed
    from smcspec.engine import timing
    from smcspec.engine.tuning import Tuner

    events = []
    llm.tuner = Tuner(lambda: events.append("profile") or timing.measure(llm.target, llm.draft))

    def logged_run(llm_, c, ids, temp, max_new, *rest):
        events.append(("run", max_new))
        return run(llm_, c, ids, temp, max_new, *rest)

    run = speed.run
    monkeypatch.setattr(speed, "run", logged_run)
    grid = build_grid(["ar", "msd", "auto", "auto-approx"], [2], [2], [2], msd_n=[2])
    plan = SpeedPlan(grid, [1.0], prompts=1, max_new_tokens=6)
    rows = {r["label"]: r for r in run_speed(llm, plan, tmp_path)}
    # profiled once, before the first timed (6-token) run: the warm-up's runs are 4 tokens
    assert events.count("profile") == 1
    assert events.index("profile") < events.index(("run", 6))
    records = {r["label"]: r for r in measurements(tmp_path / "speed.jsonl")}
    assert records["auto approx"]["settings"] == {"approximate": True}  # kept beside `chosen`
    assert sum(seg["rounds"] for seg in records["auto"]["chosen"]) == records["auto"]["rounds"]
    top = max(records["auto"]["chosen"], key=lambda seg: seg["rounds"])
    named = " ".join([top["method"], *(f"{k}={top[v]}" for k, v in NK if v in top)])
    assert rows["auto"]["chose"].startswith(f"{named} (")  # most rounds first
    assert rows["msd N=2 K=2"]["acceptance_rate"] is not None and rows["ar"]["chose"] is None
    text = (tmp_path / "speed.md").read_text()
    assert "profiled (or read from the model cache's costs/) in the untimed warm-up" in text
    assert f"| {rows['auto']['chose']} |" in text and "| auto / best exact |" in text


def test_scoring_a_reply_gives_its_kv_pages_back(tiny_folder, tiny_draft_folder):
    """Each accuracy record scores its reply on a cache of its own; a 100-problem run kept
    every one of them and ran the 4,096-page pool dry."""
    tiny = LLM(str(tiny_folder), str(tiny_draft_folder), backend="native", dtype="float32")
    before = tiny.target.pages.free_pages
    for _ in range(3):
        assert accuracy.target_logp(tiny, list(range(1, 40)), list(range(1, 60))) < 0
    assert tiny.target.pages.free_pages == before


def test_an_smc_row_names_its_resampling_threshold_when_it_is_not_the_default():
    # two runs at different thresholds must not share labels: the label is the resume key
    default = build_grid(["smc"], [4], [2], [8])
    assert [c.label for c in default] == ["smc N=2 K=8"]
    always = build_grid(["smc"], [4], [2], [8], resample_threshold=1.0, smc_power=[2.0])
    assert [c.label for c in always] == ["smc N=2 K=8 ESS<1N", "smc N=2 K=8 ESS<1N power=2"]
