"""`smcspec bench serve` end to end on the tiny pair: every level measured, batching visible."""

import dataclasses
from types import SimpleNamespace

import pytest
import requests

from smcspec.bench import serving
from smcspec.bench.results import measurements
from smcspec.bench.serving import ServePlan, run_serve_bench
from smcspec.server.metrics import ServerMetrics


def test_serve_bench_measures_every_level_and_resumes(
    tmp_path, tiny_llama_folder, tiny_llama_draft_folder
):
    methods = ("ar", "smc N=2 K=8", "auto approx")
    plan = ServePlan(methods=methods, concurrency=(1, 3), requests=3, max_tokens=5)
    serve_args = ["--target", str(tiny_llama_folder), "--draft", str(tiny_llama_draft_folder)]
    serve_args += ["--dtype", "float32"]
    prompts = ["w1 w2", "w3 w4 w5", "w6"]
    table = run_serve_bench(plan, serve_args, tmp_path, prompts)
    records = measurements(tmp_path / "serve.jsonl")
    rows = [r for r in records if "method" in r]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("ar", 1),
        ("ar", 3),
        ("smc N=2 K=8", 1),
        ("smc N=2 K=8", 3),
        ("auto approx", 1),
        ("auto approx", 3),
    ]
    for r in rows:
        assert r["requests"] == 3 and r["tokens"] == 15
        assert r["tokens_per_second"] > 0 and r["ttft_mean"] is not None
        assert 0 < r["forward_share"] <= 1 and r["prompt_tokens"] > 0
    ar1, ar3 = rows[0], rows[1]
    assert ar1["rows_per_target_pass"] < ar3["rows_per_target_pass"]
    assert rows[2]["ess_fraction"] is not None and rows[2]["acceptance"] is None
    assert rows[4]["chose"] is not None and rows[0]["chose"] is None
    # header row + 6 levels, auto's summary: header + 2 levels, round trip header + 1 server
    assert table.count("\n| ") == 12
    summary = table.split("auto against the fastest fixed setting")[1].splitlines()
    cells = summary[4].split(" | ")  # ar the only exact fixed setting; no plain auto here
    assert cells[:3] == ["| 1 process", "1", "ar"] and cells[4:6] == ["-", "-"]
    assert cells[6] in ("ar", "smc N=2 K=8") and cells[8].endswith("x |")
    assert (tmp_path / "serve.md").read_text() == table
    again = run_serve_bench(plan, serve_args, tmp_path, prompts)  # all done: nothing reruns
    assert again == table and measurements(tmp_path / "serve.jsonl") == records


@pytest.mark.xdist_group("ray")
def test_serve_bench_measures_replicas_on_ray_beside_one_process(
    tmp_path, tiny_llama_folder, tiny_llama_draft_folder
):
    pytest.importorskip("ray.serve")
    plan = ServePlan(methods=("sd K=4",), concurrency=(1, 2), requests=2, max_tokens=4)
    plan = dataclasses.replace(plan, replicas=(0, 2))
    serve_args = ["--target", str(tiny_llama_folder), "--draft", str(tiny_llama_draft_folder)]
    serve_args += ["--dtype", "float32"]
    table = run_serve_bench(plan, serve_args, tmp_path, ["w1 w2", "w3"])
    records = measurements(tmp_path / "serve.jsonl")
    rows = [(r["replicas"], r["concurrency"]) for r in records if "method" in r]
    assert rows == [(0, 1), (0, 2), (2, 1), (2, 2)]
    for r in records:
        if "method" in r:  # the passes were read from /metrics, summed over the replicas
            assert r["target_passes"] > 0 and 0 < r["forward_share"] <= 1
        else:
            assert 0 < r["roundtrip_ms_median"] <= r["roundtrip_ms_p95"]
    assert "| Ray, 2 replicas | sd K=4 | 2 |" in table and "| 1 process | sd K=4 | 1 |" in table


def test_the_scrape_reads_graph_replays_and_both_models_passes(monkeypatch):
    """The names `_level` reads are the ones /metrics writes (a misspelt one would read 0)."""
    stats = SimpleNamespace(forwards=[7, 9], rows=[20, 30], seconds=[1.5, 0.5], replays=[6, 8])
    models = (SimpleNamespace(), SimpleNamespace())  # no page pools
    scheduler = SimpleNamespace(queued=0, running=0, models=models, stats=stats)
    text = ServerMetrics(scheduler, serving.MODEL_NAME).render().decode()
    monkeypatch.setattr(requests, "get", lambda *a, **kw: SimpleNamespace(text=text))
    got = serving._scrape("http://unused")
    assert got["forwards"] == 7 and got["draft_forwards"] == 9
    assert got["target_replays"] == 6 and got["draft_replays"] == 8


def test_serve_methods_are_bench_speed_labels_checked_as_the_server_checks_them():
    assert serving.method_fields("msd N=2 K=4") == {
        "method": "msd",
        "particles": 2,
        "draft_tokens": 4,
    }
    assert serving.method_fields("sd K=8") == {"method": "sd", "draft_tokens": 8}
    assert serving.method_fields("auto") == {"method": "auto"}
    assert serving.method_fields("auto approx") == {"method": "auto", "approximate": True}
    for label in ("sd N=2 K=4", "msd K=4", "beam", "auto exact", "msd N=2 K=4 "):
        with pytest.raises(ValueError, match="unknown method"):
            serving.method_fields(label)
    with pytest.raises(ValueError, match=r"'msd N=0 K=4': particles \(N\)"):
        ServePlan(methods=("ar", "msd N=0 K=4"))
    with pytest.raises(ValueError, match=r"'smc N=65 K=4': particles .* <= 64"):
        ServePlan(methods=("smc N=65 K=4",))


class _Started(Exception):
    pass


@pytest.mark.parametrize(("methods", "default"), [(("sd K=4", "ar"), "ar"), (("auto",), None)])
def test_the_server_measures_autos_costs_only_when_auto_is_benched(
    tmp_path, monkeypatch, methods, default
):
    """Every request names its method: a server started for fixed settings alone defaults to ar,
    so that it does not first profile auto's step costs (about 100 s on the default pair)."""
    started: list[list[str]] = []

    def start(args, port):
        started.append(args)
        raise _Started

    monkeypatch.setattr(serving, "_start", start)
    plan = ServePlan(methods=methods, concurrency=(1,), requests=1, max_tokens=2)
    with pytest.raises(_Started):
        serving._measure_server(plan, 0, ["--dtype", "float32"], tmp_path, [], "prompts")
    args = started[0]
    given = args[args.index("--method") + 1] if "--method" in args else None
    assert given == default
