"""scripts/gpu_check as stages (`gpu.stages`): a stage that raises leaves its traceback in gpu.md
and the run goes on (exit 3), the time budget turns checks into "not run" (never "passed",
exit 4), --pairs chooses the pairs, and the floor of a step is bytes over a read-only
bandwidth. In-process on the smoke plan, cut down to seconds."""

import dataclasses
import runpy
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smcspec.bench.gpu import probes as gpu_probes
from smcspec.bench.gpu import runner as gpu
from smcspec.bench.gpu.checks import graphs_vs_eager, scheduler_batch
from smcspec.bench.gpu.pairs import PAIRS, GpuPlan, build_pair, load_config, pair_llm
from smcspec.bench.gpu.stages import CRASHED, INCOMPLETE
from smcspec.bench.gpu.targets import TARGETS, targets_table
from smcspec.bench.results import header, measurements
from smcspec.models.graphs import GraphRunner
from smcspec.models.llama import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
FIRST, SECOND = PAIRS
SCRIPT = runpy.run_path(str(ROOT / "scripts/gpu_check"), run_name="gpu_check")


def small_plan() -> GpuPlan:
    """The smoke plan on one pair, one method, no grids: the fewest stages of each kind."""
    return dataclasses.replace(
        GpuPlan.smoke(),
        pairs=(FIRST,),
        verify=((1, 4),),
        draft_batches=(1,),
        methods=(("ar", 1, 0),),
        kernel_cases=((1, 1, 32),),
    )


def keys(out: Path) -> set[str]:
    return {r["key"] for r in measurements(out / "gpu.jsonl")}


def test_a_stage_that_raises_is_a_crash_row_and_later_stages_run(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom in the step grid")

    monkeypatch.setattr(gpu, "step_ms", boom)
    outcome = gpu.run_all(small_plan(), tmp_path, only="bench")
    assert outcome.crashed == [f"{FIRST} graphs: step grid", f"{FIRST} eager: step grid"]
    assert outcome.exit_code == CRASHED and outcome.failures == []
    # what comes after the step grids ran: end to end, transformers, the probes
    assert {f"e2e|{FIRST}|graphs|ar", f"hf|{FIRST}", f"prefill|{FIRST}"} <= keys(tmp_path)
    text = (tmp_path / "gpu.md").read_text()
    assert "## Stages that raised" in text and "RuntimeError: boom in the step grid" in text
    assert f"### {FIRST} eager: step grid" in text


def test_a_check_that_raises_is_not_passed_and_the_script_exits_3(tmp_path, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("graph capture failed")

    monkeypatch.setattr(gpu, "graphs_vs_eager", boom)
    monkeypatch.setattr(gpu, "native_vs_transformers", lambda *a: [])  # seconds saved
    argv = ["--smoke", "--out", str(tmp_path), "--pairs", FIRST, "--only", "correctness"]
    assert SCRIPT["main"](argv) == CRASHED
    out = capsys.readouterr().out
    assert "correctness passed" not in out and "correctness incomplete" in out
    assert f"RAISED: {FIRST} graphs vs eager" in out
    assert f"check|{FIRST} sd K=4: one new token" in keys(tmp_path)  # the next stages ran
    assert "RuntimeError: graph capture failed" in (tmp_path / "gpu.md").read_text()


def test_no_time_left_reports_checks_as_not_run_never_passed(tmp_path, capsys):
    argv = ["--smoke", "--out", str(tmp_path), "--time-budget", "0"]
    assert SCRIPT["main"](argv) == INCOMPLETE
    out = capsys.readouterr().out
    assert "passed" not in out.splitlines()[-1]
    assert "gpu_check: correctness incomplete" in out
    text = (tmp_path / "gpu.md").read_text()
    for name in PAIRS:
        assert f"- {name} graphs vs eager: time budget" in text
        assert f"- {name}: build for the checks (float32): time budget" in text
    assert "| not run |" in text  # the targets
    assert "| pass |" not in text


def test_the_outcome_says_passed_only_when_every_check_ran():
    done = gpu.Outcome(failures=[], skipped=[], report="")
    assert done.verdict() == "passed" and done.exit_code == 0
    cut = gpu.Outcome(failures=[], skipped=["x (time budget)"], report="", unchecked=["x"])
    assert cut.verdict().startswith("incomplete") and cut.exit_code == INCOMPLETE
    bench_only = gpu.Outcome(failures=[], skipped=["e2e (time budget)"], report="")
    assert bench_only.exit_code == 0
    failed = gpu.Outcome(failures=["f"], skipped=[], report="", crashed=["s"])
    assert failed.exit_code == 1 and failed.verdict().startswith("FAILED")


def test_pairs_chooses_the_pairs_and_an_unknown_one_is_refused(tmp_path, capsys):
    argv = ["--smoke", "--out", str(tmp_path), "--pairs", SECOND, "--time-budget", "0"]
    SCRIPT["main"](argv)
    assert header(tmp_path / "gpu.jsonl")["plan"]["pairs"] == [SECOND]
    assert not any(FIRST in key for key in keys(tmp_path))
    assert any(SECOND in key for key in keys(tmp_path))
    assert SCRIPT["main"](["--smoke", "--out", str(tmp_path), "--pairs", "llama-70b"]) == 2
    assert "pairs: unknown pair 'llama-70b'" in capsys.readouterr().err


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_floor_is_weight_bytes_over_a_read_only_bandwidth(monkeypatch):
    timed: list = []

    def one_ms(fn, plan):
        timed.append(fn)
        return 1.0

    monkeypatch.setattr(gpu_probes, "bench_ms", one_ms)
    plan = GpuPlan.smoke()
    bandwidth = gpu_probes.read_bandwidth(plan)
    assert bandwidth["read_bytes_per_s"] == plan.bandwidth_bytes / 1e-3
    with _Ops() as spy:
        timed[0]()
    assert spy.ops == ["sum.default"]  # read once, nothing written back: not a copy
    config = LlamaConfig.from_hf(load_config("qwen2.5-7b-instruct"))
    nbytes = gpu.weight_bytes(config, "bfloat16")
    floor = gpu_probes.step_floor(nbytes, bandwidth["read_bytes_per_s"])
    assert floor == pytest.approx(1e3 * nbytes / (plan.bandwidth_bytes / 1e-3))
    assert 14e9 < nbytes < 15e9


def test_the_bench_floor_record_uses_the_read_bandwidth(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_probes,
        "read_bandwidth",
        lambda plan: {"read_bytes": 1, "read_ms": 1, "read_bytes_per_s": 2e9},
    )
    for stage in ("pair_llm", "hf_generate"):  # everything after the floor: seconds saved
        monkeypatch.setattr(gpu, stage, lambda *a: 1 / 0)
    gpu.run_all(small_plan(), tmp_path, only="bench")
    records = {r["key"]: r for r in measurements(tmp_path / "gpu.jsonl")}
    floor = records[f"floor|{FIRST}"]
    assert floor["floor_ms"] == pytest.approx(1e3 * floor["weight_bytes"] / 2e9)
    assert "at 2 GB/s (a read-only reduction" in (tmp_path / "gpu.md").read_text()


def test_the_targets_pass_miss_or_were_not_run():
    name = FIRST
    records = {
        f"floor|{name}": {"floor_ms": 3.3, "heads": [28, 4, 128], "layers": 28},
        f"steps|{name}|graphs": {"ms": {"target step": 4.0, "draft step batch 8": 1.5}},
        f"long|{name}": {"verify 8x9 at 2048": 7.5, "target step at 2048": 6.0,
                         "target step at 4096": 10.0},
        "kernel": {"heads": [28, 4, 128], "ms": {"1 x 1 at 4096": 0.05}},
        f"e2e|{name}|graphs|ar": {"decode_tokens_per_second": 100.0},
        f"e2e|{name}|graphs|smc N=8 K=8": {"decode_tokens_per_second": 260.0},
        f"syncs|{name}|sd K=4": {"syncs_per_round": 2.0},
        f"prefill|{name}": {"fits": False, "tokens": 32000},
    }  # fmt: skip
    got = {t.what: t.judge(name, records) for t in TARGETS}
    assert got["target step <= 1.3x its floor"] == (pytest.approx(4.0 / 3.3), True)
    assert got["72-row verify at 2048 keys <= 1.3x a one-token step"] == (1.25, True)
    assert got["attention < 15% of a step at 4096 keys"] == (pytest.approx(0.14), True)
    assert got["draft step <= 1 ms at batch 1-8 (slowest, ms)"] == (1.5, False)
    assert got["smc N=8 K=8 >= 2.5x ar (decode, graphs)"] == (2.6, True)
    assert got["sd K=4 >= 2x ar (decode, predicted at a = 0.95)"] == (None, None)
    assert got["host syncs per sd K=4 round <= 1"] == (2.0, False)
    assert got["a 32k-token prefill fits (peak / device memory)"] == (float("inf"), False)
    table = "\n".join(targets_table([name], records))
    assert "| 1.5 | **miss** |" in table and "| - | not run |" in table


def test_the_sdpa_spy_names_the_backend_of_each_call():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8)
    with gpu_probes.SdpaChoices() as spy:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert len(spy.backends) == 1 and spy.backends[0] in {"flash_attention", "math"}


def test_the_padded_logits_check_fails_when_no_graph_served_the_batch(monkeypatch):
    plan = small_plan()
    pair = build_pair(plan, FIRST)
    monkeypatch.setattr(GraphRunner, "run", lambda self, *args, **kwargs: None)  # all eager
    rows = graphs_vs_eager(pair, plan)
    padded = next(r for r in rows if "(padded)" in r["check"])
    assert padded["diff"] == 0.0  # eager against eager
    assert not padded["ok"] and "not served by a graph" in padded["failure"]


def test_the_scheduler_check_reports_the_share_of_passes_graphs_served():
    plan = small_plan()
    (row,) = scheduler_batch(build_pair(plan, FIRST), plan)
    assert row["ok"] and 0 < row["replays"] <= row["passes"]


class _PassesAfter:
    """A deadline that passes after `calls` checks."""

    def __init__(self, calls: int) -> None:
        self.left = calls

    def passed(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_the_deadline_stops_a_step_grid_between_rows():
    plan = dataclasses.replace(small_plan(), verify=((1, 4), (2, 4)))
    llm = pair_llm(build_pair(plan, FIRST), False, plan)
    ms = gpu.step_ms(llm, list(range(1, 33)), plan, _PassesAfter(1))
    assert ms["target step"] > 0
    assert ms["verify 1x4"] is ms["verify 2x4"] is ms["draft step batch 1"] is None


def test_rows_a_stage_left_out_are_not_run_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "step_ms", lambda *a: {"target step": 1.0, "verify 1x4": None})
    for stage in ("e2e", "hf_generate", "_graph_probes"):
        monkeypatch.setattr(gpu, stage, lambda *a: None)
    outcome = gpu.run_all(small_plan(), tmp_path, only="bench")
    assert f"{FIRST} eager: verify 1x4 (time budget)" in outcome.skipped
    text = (tmp_path / "gpu.md").read_text()
    assert "| verify 1x4 | not run | not run | - |" in text
    assert f"- {FIRST} graphs: verify 1x4: time budget" in text


def test_a_long_prefill_that_runs_out_of_memory_is_a_finding_not_a_crash(monkeypatch):
    plan = small_plan()
    llm = pair_llm(build_pair(plan, FIRST), False, plan)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 120.00 GiB")

    monkeypatch.setattr(llm.target, "forward", out_of_memory)
    record = gpu_probes.long_prefill(llm, 64, plan)
    assert not record["fits"] and record["error"].startswith("CUDA out of memory")
    monkeypatch.setattr(llm.target, "forward", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gpu_probes.long_prefill(llm, 64, plan)


def test_bench_gpu_exits_with_the_scripts_codes(tmp_path, capsys):
    """`smcspec bench gpu` is the same run as scripts/gpu_check: a budget that cuts the checks
    exits 4 (never 0), and an unknown pair is one line and exit 2 before anything is built."""
    from smcspec.cli import main

    argv = ["bench", "gpu", "--smoke", "--out", str(tmp_path), "--pairs", SECOND]
    assert main([*argv, "--time-budget", "0"]) == INCOMPLETE
    assert header(tmp_path / "gpu.jsonl")["plan"]["pairs"] == [SECOND]
    assert "not run:" in capsys.readouterr().err
    assert main(["bench", "gpu", "--smoke", "--out", str(tmp_path), "--pairs", "llama-70b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown pair 'llama-70b'" in err[0]
