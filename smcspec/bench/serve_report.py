"""The Markdown report of `smcspec bench serve` (`serving`): one row per server, method and
concurrency level from serve.jsonl, auto against the fastest fixed setting at each level, and the
round trip of an empty request per server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smcspec.bench.machine import ran_on
from smcspec.bench.report import _fmt
from smcspec.bench.results import header, machines, measurements


def report(path: str | Path) -> str:
    """Markdown table of serve.jsonl: one row per (server, method, concurrency), and the
    round trip of an empty request per server."""
    head = header(path)
    records = measurements(path)
    rows = [r for r in records if "method" in r]
    trips = [r for r in records if "roundtrip_ms_median" in r]
    base = {
        (r.get("replicas", 0), r["method"]): r["tokens_per_second"]
        for r in rows
        if r["concurrency"] == 1
    }
    lines = _preamble(head, machines(path), ray=any(r.get("replicas") for r in records))
    lines += [_level_row(r, base.get((r.get("replicas", 0), r["method"]))) for r in rows]
    if any(r["method"].startswith("auto") for r in rows):
        lines += _auto_against_fixed(rows)
    if trips:
        lines += _roundtrips(trips)
    return "\n".join(lines) + "\n"


def _auto_against_fixed(rows: list[dict[str, Any]]) -> list[str]:
    """Per server and concurrency: the fastest fixed exact setting (ar, sd, msd) and the fastest
    of all (smc too), and auto's and auto approx's tokens/s over them."""
    lines = [
        "",
        "auto against the fastest fixed setting at each level (tokens/s ratios):",
        "",
        "| server | C | best fixed exact | tok/s | auto / best exact | auto chose (share of "
        "rounds) | best fixed | tok/s | auto approx / best fixed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    levels = dict.fromkeys((r.get("replicas", 0), r["concurrency"]) for r in rows)
    for replicas, c in levels:
        here = {
            r["method"]: r
            for r in rows
            if (r.get("replicas", 0), r["concurrency"]) == (replicas, c)
        }
        fixed = [r for m, r in here.items() if m.split()[0] in ("ar", "sd", "msd", "smc")]
        exact = [r for r in fixed if r["method"].split()[0] != "smc"]
        best_exact, best = (max(rs, key=_tps, default=None) for rs in (exact, fixed))
        auto, approx = here.get("auto"), here.get("auto approx")
        lines.append(
            f"| {_server(replicas)} | {c} | {_name(best_exact)} | {_fmt(_tps(best_exact))} "
            f"| {_over(auto, best_exact)} | {_fmt(auto and auto.get('chose'))} | {_name(best)} "
            f"| {_fmt(_tps(best))} | {_over(approx, best)} |"
        )
    return lines


def _tps(r: dict[str, Any] | None) -> float | None:
    return r["tokens_per_second"] if r else None


def _name(r: dict[str, Any] | None) -> str:
    return r["method"] if r else "-"


def _over(r: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    return f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x" if r and base else "-"


def _preamble(head: dict[str, Any], ran: list[dict[str, Any]], ray: bool) -> list[str]:
    """The title, the machines it `ran` on, what was run and what each column means, the table's
    head."""
    plan = head.get("plan", {})
    models = head.get("models", {})
    servers = (
        "one `smcspec serve` process or its replicas on Ray Serve"
        if ray
        else ("one `smcspec serve` process")
    )
    return [
        "# smcspec serve under concurrent clients",
        "",
        f"Machine: {ran_on(ran) if ran else 'not recorded'}.",
        "",
        f"Models: target {models.get('target', '?')}, draft {models.get('draft', '?')}; "
        f"{servers}; {plan.get('requests')} chat "
        f"requests ({head.get('prompts', '?')}), {plan.get('max_tokens')} new tokens each (EOS "
        f"ignored), T={plan.get('temperature')}, streamed; C clients at a time. Concurrency 1 "
        "is the same requests served one at a time. x = tokens/s over the method's own "
        "concurrency-1 row on the same server. prompt tok/s: prompt tokens prefilled per second "
        "of the level. in passes: share of the wall time spent inside batched forward passes "
        "(the rest is per-request sampling, scheduling and HTTP; summed over replicas). graph "
        "replays: share of both models' passes served by a CUDA graph (0 off CUDA).",
        "",
        "| server | method | C | req/s | tok/s | x | prompt tok/s | latency mean / p95 (s) "
        "| TTFT mean / median (s) | target rows/pass | in passes | graph replays | acceptance "
        "| ESS/N | resamples/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _level_row(r: dict[str, Any], one: float | None) -> str:
    """One (server, method, concurrency) row; `one` is its concurrency-1 tokens/s."""
    speedup = r["tokens_per_second"] / one if one else None
    return (
        f"| {_server(r.get('replicas', 0))} | {r['method']} | {r['concurrency']} "
        f"| {_fmt(r['requests_per_second'])} "
        f"| {_fmt(r['tokens_per_second'])} | {_fmt(speedup)} "
        f"| {_fmt(r['prompt_tokens'] / r['seconds'])} "
        f"| {_fmt(r['latency_mean'])} / {_fmt(r['latency_p95'])} "
        f"| {_fmt(r['ttft_mean'])} / {_fmt(r['ttft_median'])} "
        f"| {_fmt(r['rows_per_target_pass'])} | {_fmt(r['forward_share'])} "
        f"| {_fmt(r.get('graph_share'))} "
        f"| {_fmt(r['acceptance'])} "
        f"| {_fmt(r['ess_fraction'])} | {_fmt(r['resamples'])} |"
    )


def _roundtrips(trips: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "Round trip of a request that does no work (`GET /v1/models`, 200 in a row on one "
        "connection): what the HTTP path adds to every request.",
        "",
        "| server | median (ms) | p95 (ms) |",
        "|---|---|---|",
    ]
    for t in trips:
        lines.append(
            f"| {_server(t['replicas'])} | {_fmt(t['roundtrip_ms_median'])} "
            f"| {_fmt(t['roundtrip_ms_p95'])} |"
        )
    return lines


def _server(replicas: int) -> str:
    return "1 process" if not replicas else f"Ray, {replicas} replica{'s' * (replicas > 1)}"
