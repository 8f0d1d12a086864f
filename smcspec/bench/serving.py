"""`smcspec bench serve`: the HTTP server under 1..C concurrent streaming clients.

One `smcspec serve` subprocess (the model options given), then for each method and each
concurrency level the same R chat requests (the first R HumanEval prompts, fixed output length,
EOS ignored), C clients at a time. Concurrency 1 is the same requests served one at a time.
A warm-up request per method runs first and is not counted. Reported per level: requests/s,
tokens/s, latency, time to first streamed token, target rows per batched forward pass, the
share of time spent in passes and the share of passes served by CUDA-graph replays (from
/metrics), and the method's diagnostics.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.bench.machine import describe, free_port
from smcspec.bench.prompts import chat_text, humaneval_problems
from smcspec.bench.report import _fmt, chose, pooled_acceptance
from smcspec.bench.results import ResultLog
from smcspec.bench.serve_report import report
from smcspec.config import SamplingConfig
from smcspec.engine import configs_from_fields
from smcspec.server.cluster import PUSH_S

MODEL_NAME = "bench"
# the default methods, labelled as `bench speed` labels them, and their request fields
METHODS = {
    "ar": {"method": "ar"},
    "sd K=4": {"method": "sd", "draft_tokens": 4},
    "smc N=2 K=8": {"method": "smc", "particles": 2, "draft_tokens": 8},
    "smc N=4 K=4": {"method": "smc", "particles": 4, "draft_tokens": 4},
}
# labels as `bench speed` writes them; those with settings: "sd K=k", "smc N=n K=k", "msd N=n K=k"
NAMED = {
    "ar": {"method": "ar"},
    "auto": {"method": "auto"},
    "auto approx": {"method": "auto", "approximate": True},
}
SETTINGS = re.compile(r"(?P<method>sd|smc|msd)(?: N=(?P<particles>\d+))? K=(?P<draft_tokens>\d+)")


def method_fields(label: str) -> dict[str, Any]:
    """The request fields of a method's label; a ValueError naming the label when it is not one
    or its settings are bad (checked as the server checks them)."""
    match = SETTINGS.fullmatch(label)
    if label in NAMED:
        return NAMED[label]
    # sd has no N; smc and msd need theirs
    if match is None or (match["particles"] is None) != (match["method"] == "sd"):
        raise ValueError(
            f"unknown method {label!r}: ar, auto, auto approx, sd K=k, smc N=n K=k or msd N=n K=k"
        )
    fields: dict[str, Any] = {
        k: int(v) for k, v in match.groupdict().items() if v and k != "method"
    }
    fields["method"] = match["method"]
    try:
        configs_from_fields(fields)
    except ValueError as err:
        raise ValueError(f"method {label!r}: {err}") from err
    return fields


@dataclass(frozen=True)
class ServePlan:
    methods: tuple[str, ...] = tuple(METHODS)
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 16
    max_tokens: int = 32
    temperature: float = SamplingConfig.temperature
    # 0: one `smcspec serve` process; n >= 1: n replicas on Ray Serve (`--replicas n`)
    replicas: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.replicas or min(self.replicas) < 0:
            raise ValueError("--replicas needs counts >= 0 (0: one process without Ray)")
        for label in self.methods:
            method_fields(label)
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--concurrency needs levels >= 1")
        if self.requests < 1 or self.max_tokens < 1:
            raise ValueError("--requests and --max-tokens must be >= 1")


def run_serve_bench(
    plan: ServePlan, serve_args: list[str], out: str | Path, prompts: list[str] | None = None
) -> str:
    """Measure every (method, concurrency) not yet in out/serve.jsonl; return the table.
    `prompts` (user messages) default to the first `plan.requests` HumanEval problems."""
    out = Path(out)
    source = "the first HumanEval prompts" if prompts is None else "prompts given by the caller"
    if prompts is None:
        prompts = [chat_text(p) for p in humaneval_problems(0, plan.requests)]
    if len(prompts) != plan.requests:
        raise ValueError(f"{plan.requests} requests need as many prompts, got {len(prompts)}")
    bodies = [_body(p, plan) for p in prompts]
    for replicas in plan.replicas:
        _measure_server(plan, replicas, serve_args, out, bodies, source)
    table = report(out / "serve.jsonl")
    (out / "serve.md").write_text(table)
    return table


def _measure_server(
    plan: ServePlan,
    replicas: int,
    serve_args: list[str],
    out: Path,
    bodies: list[dict],
    source: str,
) -> None:
    """Every (method, concurrency) of one server: one process, or `replicas` on Ray."""
    suffix = "" if replicas == 0 else f"|{replicas} replicas"
    keys = {(m, c): f"{m}|{c}{suffix}" for m in plan.methods for c in plan.concurrency}
    trip = f"roundtrip{suffix}"
    if {*keys.values(), trip} <= ResultLog.existing(out / "serve.jsonl"):
        return  # all measured: no server to start
    port = free_port()
    args = [*serve_args, "--max-running", str(max(plan.concurrency))]
    if not any(label.startswith("auto") for label in plan.methods) and "--method" not in args:
        args += ["--method", "ar"]  # requests name their method: auto's costs go unmeasured
    if replicas:  # the machine's cores shared out, so that n replicas compute on all of them
        cpus = max(1, (os.cpu_count() or 1) // replicas)
        args += ["--replicas", str(replicas), "--replica-cpus", str(cpus)]
    proc = _start(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        info = wait_ready(url, proc, replicas=replicas)
        precision = f"{info['dtype']}, {info['backend']} backend"
        log = ResultLog(
            out / "serve.jsonl",
            {
                "machine": describe(precision),
                "models": {"target": info["target"], "draft": info["draft"]},
                "plan": plan.__dict__,
                "prompts": source,
            },
        )
        if not log.has(trip):
            log.add(trip, {"replicas": replicas, **_round_trip(url)})
        for label in plan.methods:
            # warm-up, not counted (auto's step costs: the server measures them as it starts)
            _one(url, {**bodies[0], **method_fields(label)})
            for c in plan.concurrency:
                key = keys[(label, c)]
                if log.has(key):
                    continue
                extra = method_fields(label)
                record = _level(url, [{**b, **extra} for b in bodies], c, settle=replicas > 0)
                log.add(key, {"method": label, "concurrency": c, "replicas": replicas, **record})
                where = f" ({replicas} replicas)" if replicas else ""
                print(f"[serve] {label} x{c}{where}: {_fmt(record['tokens_per_second'])} tok/s")
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def _round_trip(url: str, n: int = 200) -> dict[str, float]:
    """Milliseconds of a request that does no work (GET /v1/models, one connection): what
    the HTTP path, Ray's proxy and router included, adds to every request."""
    import requests

    with requests.Session() as session:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            session.get(url + "/v1/models", timeout=30).raise_for_status()
            times.append(1000 * (time.perf_counter() - start))
    times.sort()
    return {
        "roundtrip_ms_median": statistics.median(times),
        "roundtrip_ms_p95": times[int(0.95 * n)],
    }


def _body(prompt: str, plan: ServePlan) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": plan.max_tokens,
        "temperature": plan.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _start(serve_args: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "smcspec", "serve", "--port", str(port)]
    cmd += ["--model-name", MODEL_NAME, *serve_args]
    return subprocess.Popen(cmd)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1800, replicas: int = 0) -> dict:
    """/health's report once the server answers (with `replicas`, once it lists them all)."""
    import requests

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"smcspec serve exited with code {proc.returncode}")
        try:
            r = requests.get(url + "/health", timeout=5)
            if r.status_code == 200 and len(r.json().get("replicas", [])) >= replicas:
                return r.json()
        except requests.RequestException:  # not listening yet, or Ray's proxy still waiting
            pass
        time.sleep(1)
    raise RuntimeError("smcspec serve did not come up")


def _level(url: str, bodies: list[dict], concurrency: int, settle: bool = False) -> dict[str, Any]:
    """All `bodies`, `concurrency` clients at a time; wall clock over the whole level.
    `settle` (replicas): /metrics holds the other replicas' counters as of their last push, so
    the scrapes wait for one more push round (outside the timed wall clock)."""
    if settle:
        time.sleep(2 * PUSH_S)
    before = _scrape(url)
    pending = list(reversed(bodies))
    lock = threading.Lock()
    done: list[dict] = []

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                body = pending.pop()
            result = _one(url, body)
            with lock:
                done.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if settle:
        time.sleep(2 * PUSH_S)
    after = _scrape(url)
    tokens = sum(r["tokens"] for r in done)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    in_passes = sum(after[k] - before[k] for k in ("target_seconds", "draft_seconds"))
    latency = sorted(r["latency"] for r in done)
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    passes = after["forwards"] - before["forwards"]
    both = passes + after["draft_forwards"] - before["draft_forwards"]
    replays = sum(after[k] - before[k] for k in ("target_replays", "draft_replays"))
    return {
        "requests": len(done),
        "seconds": wall,
        "requests_per_second": len(done) / wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "prompt_tokens": prompt_tokens,
        "forward_share": in_passes / wall,
        "latency_mean": statistics.fmean(latency),
        "latency_p95": latency[min(len(latency) - 1, int(0.95 * len(latency)))],
        "ttft_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_median": statistics.median(ttft) if ttft else None,
        "target_passes": passes,
        "rows_per_target_pass": (after["rows"] - before["rows"]) / passes if passes else None,
        "graph_share": replays / both if both else None,  # of both models' passes
        **_diagnostics([r["diagnostics"] for r in done]),
    }


def _one(url: str, body: dict) -> dict[str, Any]:
    """One streamed chat request: latency, time to the first text, tokens, diagnostics."""
    import requests

    start = time.perf_counter()
    ttft, tokens, prompt_tokens, diagnostics = None, 0, 0, {}
    path = url + "/v1/chat/completions"
    with requests.post(path, json=body, stream=True, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines(decode_unicode=True):
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']['message']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk["choices"]:
                if ttft is None and choice["delta"].get("content"):
                    ttft = time.perf_counter() - start
                if "smcspec" in choice:
                    diagnostics = choice["smcspec"]["diagnostics"]
    return {
        "latency": time.perf_counter() - start,
        "ttft": ttft,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "diagnostics": diagnostics,
    }


def _diagnostics(all_diags: list[dict]) -> dict[str, float | None]:
    """Means over requests: sd acceptance (msd's and auto's pooled over the requests); smc ESS /
    N and resamples per request; what auto chose (`bench.report.chose`)."""
    acceptance = [d["acceptance_rate"] for d in all_diags if d.get("acceptance_rate") is not None]
    pooled = pooled_acceptance(all_diags) if not acceptance else None
    ess = [
        statistics.fmean(d["ess"]) / len(d["weights"])
        for d in all_diags
        if d.get("ess") and d.get("weights")
    ]
    resamples = [d["resamples"] for d in all_diags if "resamples" in d]
    return {
        "acceptance": statistics.fmean(acceptance) if acceptance else pooled,
        "ess_fraction": statistics.fmean(ess) if ess else None,
        "resamples": statistics.fmean(resamples) if resamples else None,
        "chose": chose([seg for d in all_diags for seg in d.get("settings") or ()]),
    }


def _scrape(url: str) -> dict[str, float]:
    import requests

    target = f'{{model_name="{MODEL_NAME}",role="target"}}'
    draft = f'{{model_name="{MODEL_NAME}",role="draft"}}'
    wanted = {
        "forwards": "smcspec:forward_passes_total" + target,
        "draft_forwards": "smcspec:forward_passes_total" + draft,
        "target_replays": "smcspec:graph_replays_total" + target,
        "draft_replays": "smcspec:graph_replays_total" + draft,
        "rows": "smcspec:forward_rows_total" + target,
        "target_seconds": "smcspec:forward_seconds_total" + target,
        "draft_seconds": "smcspec:forward_seconds_total" + draft,
    }
    values = parse_metrics(requests.get(url + "/metrics", timeout=30).text)
    summed: dict[str, float] = {}
    for name, value in values.items():  # replicas' samples summed over their `replica` label
        plain = _REPLICA_LABEL.sub("", name)
        summed[plain] = summed.get(plain, 0.0) + value
    return {key: summed.get(name, 0.0) for key, name in wanted.items()}


_REPLICA_LABEL = re.compile(r',replica="[^"]*"|replica="[^"]*",?')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
