"""`bench gpu` and scripts/gpu_check on the smoke plan: tiny random models on the CPU, graphs
through `eager_capture`; the correctness checks pass on them and fail when something breaks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smcspec.bench.gpu.checks import check_correctness
from smcspec.bench.gpu.pairs import PAIRS, QK_SCALE, GpuPlan, build_pair, load_config, pair_weights
from smcspec.bench.gpu.runner import run_all, sd_tokens_per_round, weight_bytes
from smcspec.bench.results import header, measurements
from smcspec.cli import main
from smcspec.models import paged_attention
from smcspec.models.llama import LlamaConfig, random_weights

ROOT = Path(__file__).resolve().parents[2]
FIRST = next(iter(PAIRS))


@pytest.fixture(scope="module")
def plan():
    return GpuPlan.smoke()


@pytest.fixture(scope="module")
def pair(plan):
    return build_pair(plan, FIRST)


def test_the_script_runs_the_smoke_plan_without_an_install(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": ""}
    cmd = [sys.executable, str(ROOT / "scripts/gpu_check"), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gpu_check: correctness passed" in done.stdout
    keys = {r["key"] for r in measurements(tmp_path / "gpu.jsonl")}
    for name in PAIRS:  # both pairs, both modes, every method, transformers beside them
        assert {f"steps|{name}|eager", f"steps|{name}|graphs", f"hf|{name}"} <= keys
        assert {f"e2e|{name}|{mode}|smc N=8 K=8" for mode in ("eager", "graphs")} <= keys
    text = (tmp_path / "gpu.md").read_text()
    assert "| sd K=4 predicted |" in text and "acceptance meaningless" in text
    assert "(1 - a^(K+1)) / (1 - a) = 4.52 tokens per round" in text
    assert "docs/benchmarks.md 'Speed on this machine'" in text and "x the floor" in text
    assert "## Targets" in text and "## Stages that raised" not in text


def test_the_bench_records_every_row_and_the_settings(plan, tmp_path):
    one = GpuPlan(**{**plan.__dict__, "pairs": (FIRST,)})
    outcome = run_all(one, tmp_path, only="bench")
    assert outcome.failures == [] and outcome.skipped == [] and outcome.crashed == []
    records = {r["key"]: r for r in measurements(tmp_path / "gpu.jsonl")}
    probes = {"bandwidth", "kernel", "sample", f"long|{FIRST}", f"sdpa|{FIRST}", f"prefill|{FIRST}"}
    assert probes | {f"syncs|{FIRST}|sd K=4", f"syncs|{FIRST}|smc N=8 K=8"} <= set(records)
    assert records[f"prefill|{FIRST}"]["fits"] and records[f"syncs|{FIRST}|sd K=4"]["rounds"] > 0
    steps = records[f"steps|{FIRST}|graphs"]["ms"]
    assert set(steps) == {"target step", "verify 1x4", "verify 2x4", "verify 2x9"} | {
        f"draft step batch {n}" for n in plan.draft_batches
    }
    e2e = [r for k, r in records.items() if k.startswith("e2e|")]
    assert len(e2e) == 2 * len(plan.methods)
    assert records[f"replays|{FIRST}|graphs"]["replays"] > 0
    assert records[f"replays|{FIRST}|eager"]["replays"] == 0
    kv = records[f"kv|{FIRST}"]
    assert 0 < kv["paged_peak_bytes"] <= kv["naive_bytes"]
    hdr = header(tmp_path / "gpu.jsonl")
    assert hdr["device_name"] == "cpu" and hdr["plan"]["dtype"] == "float32"
    assert "# Native engine on cpu (float32" in outcome.report


def test_a_time_budget_skips_and_says_so(plan, tmp_path):
    outcome = run_all(plan, tmp_path, only="bench", budget_s=0)
    assert [s for s in outcome.skipped if s.endswith(": bench (time budget)")] == [
        f"{name}: bench (time budget)" for name in PAIRS
    ]
    assert "## Not run" in outcome.report and outcome.unchecked == []


def test_correctness_passes_on_the_tiny_pair(pair, plan):
    assert check_correctness(pair, plan) == []


def test_correctness_fails_on_one_corrupted_weight(pair, plan):
    weight = pair.target.layers[0].o.weight
    before = weight[0, 0].clone()
    weight[0, 0] += 0.5
    try:
        failures = check_correctness(pair, plan, roles=("target",), graphs=False)
    finally:
        weight[0, 0] = before
    assert any("target: prefill" in f for f in failures)


def test_correctness_fails_when_attention_misses_the_newest_key(pair, plan, monkeypatch):
    def one_key_fewer(q, k, v, tables, seq_index, positions, scale, **packing):
        return paged_attention.reference(
            q, k, v, tables, seq_index, (positions - 1).clamp(min=0), scale
        )

    monkeypatch.setattr(pair.target.attention, "_fn", one_key_fewer)
    failures = check_correctness(pair, plan, roles=("target",), graphs=False)
    assert any("decode step" in f for f in failures)
    assert any("resampled row" in f for f in failures)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal needs a machine without CUDA")
def test_bench_gpu_without_cuda_refuses_in_one_line(tmp_path, capsys):
    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err
    assert not (tmp_path / "gpu.jsonl").exists()


def test_the_plan_checks_its_settings():
    with pytest.raises(ValueError, match="unknown pair"):
        GpuPlan(pairs=("llama-70b",))
    with pytest.raises(ValueError, match="dtype"):
        GpuPlan(dtype="int8")
    with pytest.raises(ValueError, match="methods"):
        GpuPlan(methods=(("smc", 0, 4),))


def test_sd_predicts_the_accepted_prefix_plus_one_token():
    # alpha is per draft, up to the first rejection: E = 1 + a + a^2 + ... + a^K
    assert sd_tokens_per_round(0.95, 4) == pytest.approx(sum(0.95**i for i in range(5)))
    assert sd_tokens_per_round(0.0, 4) == 1.0
    assert sd_tokens_per_round(1.0, 4) == 5.0


def test_the_step_floor_reads_a_tied_head_too():
    cfg = load_config("qwen2.5-coder-0.5b-instruct")
    assert cfg["tie_word_embeddings"] is True
    tied = LlamaConfig.from_hf(cfg)
    untied = LlamaConfig.from_hf({**cfg, "tie_word_embeddings": False})
    assert weight_bytes(tied, "bfloat16") == weight_bytes(untied, "bfloat16")
    head = 2 * cfg["vocab_size"] * cfg["hidden_size"]
    assert weight_bytes(tied, "bfloat16") > head


def test_pair_weights_sharpen_only_queries_and_keys():
    config = LlamaConfig.from_hf(load_config("qwen2.5-coder-0.5b-instruct", tiny=True))
    plain, sharp = random_weights(config, "cpu", 3), pair_weights(config, "cpu", 3)
    for name, tensor in plain.items():
        scale = QK_SCALE if ".q_proj." in name or ".k_proj." in name else 1.0
        assert torch.equal(sharp[name], tensor * scale), name
