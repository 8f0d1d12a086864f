"""`bench engine` end to end on two tiny random Qwen2 models, both engines, no download."""

import pytest

from smcspec import LLM
from smcspec.bench.contenders import build_grid
from smcspec.bench.engine import EnginePlan, run_engine
from smcspec.bench.results import measurements
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    save_tiny_model(target, seed=0)
    save_tiny_model(draft, seed=1)
    return {b: LLM(str(target), str(draft), backend=b, dtype="float32") for b in ("native", "hf")}


def test_engine_bench_compares_both_engines_and_resumes(pair, tmp_path, monkeypatch):
    # the tiny word-level tokenizer cannot spell HumanEval prompts: give token ids
    prompts = [[4 + i % 50 for i in range(40)], [11, 12, 13]]
    monkeypatch.setattr("smcspec.bench.engine.prompt_ids", lambda llm, n: prompts[:n])
    grid = build_grid(["ar", "sd", "smc"], [2], [2], [2])
    plan = EnginePlan(
        grid, context=8, prompts=2, max_new_tokens=6, reps=2, resample_tokens=16, verify_rows=(1, 2)
    )
    text = run_engine(pair, plan, tmp_path)
    assert "| target step |" in text and "| verify 8 tokens |" in text
    assert "| draft step batch 8 |" in text and "| resample 8 particles at 24 tokens |" in text
    records = measurements(tmp_path / "engine.jsonl")
    e2e = [r for r in records if r["key"].startswith("e2e|")]
    assert len(e2e) == 2 * 2 * 3  # prompts x engines x methods
    assert {r["backend"] for r in e2e} == {"native", "hf"}
    kv = next(r for r in records if r["key"] == "kv|native")
    # particles share the prompt's two full pages, so the peak is below N private copies
    assert 0 < kv["paged_peak_bytes"] < kv["naive_bytes"]
    assert kv["saving"] == pytest.approx(1 - kv["paged_peak_bytes"] / kv["naive_bytes"])
    run_engine(pair, plan, tmp_path)  # resumes: nothing left to do
    assert len(measurements(tmp_path / "engine.jsonl")) == len(records)


def test_engine_plan_checks_its_settings():
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match="context"):
        EnginePlan(grid, context=1)
    with pytest.raises(ValueError, match="reps"):
        EnginePlan(grid, reps=0)
    with pytest.raises(ValueError, match="no methods"):
        EnginePlan([])
