"""The Markdown report of `smcspec bench gpu` (gpu.md), written from gpu.jsonl alone: its
header (`run_header`: machine, device, plan, shapes, the sd acceptance assumed) and one record
per measurement or check."""

from __future__ import annotations

import importlib.metadata
import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from smcspec.bench import machine
from smcspec.bench.gpu.pairs import (
    PAIRS,
    SD_ACCEPTANCE,
    SD_ACCEPTANCE_PAIR,
    SD_ACCEPTANCE_SOURCE,
    GpuPlan,
    load_config,
)
from smcspec.bench.gpu.targets import targets_table
from smcspec.bench.results import header, measurements


def run_header(plan: GpuPlan) -> dict[str, Any]:
    device = torch.device(plan.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    settings = {f.name: getattr(plan, f.name) for f in fields(plan)}
    shapes = {n: _shape(load_config(n, plan.tiny)) for pair in plan.pairs for n in PAIRS[pair]}
    return {
        "machine": machine.describe(plan.dtype, plan.device),
        "device_name": name,
        "plan": settings,
        "shapes": shapes,
        "sd_acceptance": {"value": SD_ACCEPTANCE, "source": SD_ACCEPTANCE_SOURCE},
        "triton": _version("triton"),
        # "highest" keeps float32 matmuls float32: the checks' 1e-3 assumes it
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shape(cfg: dict) -> str:
    return (
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP "
        f"{cfg['intermediate_size']}, {cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']} heads, vocab {cfg['vocab_size']}"
    )


def write_report(out_dir: str | Path) -> str:
    out = Path(out_dir)
    path = out / "gpu.jsonl"
    hdr, records = header(path), {r["key"]: r for r in measurements(path)}
    plan = hdr["plan"]
    lines = [
        f"# Native engine on {hdr['device_name']} ({plan['dtype']}, attention {plan['attention']})",
        "",
        f"{machine.one_line(hdr['machine'])}, Triton {hdr.get('triton')}, float32 matmul "
        f"precision {hdr.get('float32_matmul_precision')}. Random N(0, 0.02) weights of the "
        f"published configs, q and k projections {plan['qk_scale']:g}x larger (peaked attention; "
        f"{plan['check_qk_scale']:g}x and {plan['check_dtype']} for the correctness checks). "
        f"Forward passes: a cache of {plan['context']} tokens, median of "
        f"{plan['reps']} timings after a warm-up, the device synchronised at each clock read. "
        f"End to end: a prompt of {plan['prompt_tokens']} random tokens, {plan['new_tokens']} "
        f"new tokens (EOS ignored), T={plan['temperature']}, seed {plan['seed']}, one request; "
        "tok/s includes the prefill, decode tok/s does not.",
    ]
    lines += _targets_report(hdr, records)
    for name in plan["pairs"]:
        lines += _pair_report(name, hdr, records)
    lines += _alone_report(records)
    lines += _checks_report(records)
    lines += _not_run_report(records)
    text = "\n".join(lines) + "\n"
    (out / "gpu.md").write_text(text)
    return text


def _targets_report(hdr: dict, records: dict[str, dict]) -> list[str]:
    return ["", "## Targets", "", *targets_table(hdr["plan"]["pairs"], records)]


def _alone_report(records: dict[str, dict]) -> list[str]:
    """The paged-attention kernel and the sampler timed alone, and the read bandwidth."""
    kernel, sample, bandwidth = (
        records.get("kernel"),
        records.get("sample"),
        records.get("bandwidth"),
    )
    if not (kernel or sample or bandwidth):
        return []
    lines = ["", "## Alone", ""]
    if bandwidth:
        lines.append(
            f"Read bandwidth: {bandwidth['read_bytes_per_s'] / 1e9:.0f} GB/s (`x.sum()` over "
            f"{bandwidth['read_bytes'] / 2**30:.1f} GiB of float32, median)."
        )
    if sample:
        lines.append(f"`sampling.sample`: {_ms(sample['value'])} ms (median).")
    if kernel:
        lines += _kernel_lines(kernel, records)
    return lines


def _kernel_lines(kernel: dict, records: dict[str, dict]) -> list[str]:
    """The kernel per case, and times the layers of the pair whose target has its heads,
    against that target's one-token step (graphs, plan.context keys)."""
    nh, nkv, d = kernel["heads"]
    floor = next(
        (
            r
            for k, r in records.items()
            if k.startswith("floor|") and r.get("heads") == kernel["heads"]
        ),
        None,
    )
    layers = floor["layers"] if floor else None
    step = records.get(f"steps|{floor['pair']}|graphs", {}).get("ms", {}) if floor else {}
    one = step.get("target step")
    lines = [
        "",
        f"| `{kernel['kernel']}` ({nh}/{nkv} heads, head_dim {d}): sequences x query tokens at "
        f"keys | ms, one layer | x {layers or '-'} layers | / one-token step ({_ms(one)} ms) |",
        "|---|---|---|---|",
    ]
    for case, ms in kernel["ms"].items():
        total = ms * layers if ms is not None and layers else None
        share = _x(total / one if total and one else None)
        lines.append(f"| {case} | {_ms(ms, True)} | {_ms(total)} | {share} |")
    return lines


def _pair_report(name: str, hdr: dict, records: dict[str, dict]) -> list[str]:
    target, draft = PAIRS[name]
    lines = [
        "",
        f"## {name}",
        "",
        f"Target {target} ({hdr['shapes'][target]}); draft {draft} ({hdr['shapes'][draft]}, "
        "vocabulary padded to the target's).",
    ]
    eager = records.get(f"steps|{name}|eager", {}).get("ms", {})
    graphs = records.get(f"steps|{name}|graphs", {}).get("ms", {})
    if eager or graphs:
        lines += [
            "",
            "| forward pass (ms) | eager | graphs | eager / graphs |",
            "|---|---|---|---|",
        ]
    for row in dict.fromkeys([*eager, *graphs]):
        e, g = eager.get(row), graphs.get(row)
        cells = [_ms(e, row in eager), _ms(g, row in graphs), _x(e / g if e and g else None)]
        lines.append(f"| {row} | {' | '.join(cells)} |")
    lines += _floor_line(name, eager, graphs, records)
    long = records.get(f"long|{name}")
    if long:
        lines += ["", "| at long contexts (graphs, ms) | |", "|---|---|"]
        lines += [f"| {row} | {_ms(ms, True)} |" for row, ms in long.items() if row != "key"]
    lines += _memory_lines(name, hdr, records)
    lines += _engine_probe_lines(name, records)
    return lines + _e2e_lines(name, hdr, records)


def _floor_line(name: str, eager: dict, graphs: dict, records: dict[str, dict]) -> list[str]:
    floor = records.get(f"floor|{name}", {})
    if "floor_ms" not in floor:
        return []
    steps = [v for v in (eager.get("target step"), graphs.get("target step")) if v]
    best = f"; the best step is {min(steps) / floor['floor_ms']:.2f}x the floor" if steps else ""
    return [
        "",
        f"Floor of a target step: {floor['weight_bytes'] / 1e9:.2f} GB of weights at "
        f"{floor['read_bytes_per_s'] / 1e9:.0f} GB/s (a read-only reduction over "
        f"{floor['read_bytes'] / 2**30:.1f} GiB) = {_ms(floor['floor_ms'])} ms{best}.",
    ]


def _engine_probe_lines(name: str, records: dict[str, dict]) -> list[str]:
    """Host syncs per round, the SDPA backends of prefills, the long prefill's memory."""
    lines = []
    syncs = {k.split("|")[2]: r for k, r in records.items() if k.startswith(f"syncs|{name}|")}
    for method, r in syncs.items():
        calls = ", ".join(f"{c} {n:.2f}" for c, n in sorted(r["calls_per_round"].items()))
        lines.append(
            f"Host syncs per {method} round (graphs, torch.profiler, {r['rounds']} rounds): "
            f"{r['syncs_per_round']:.2f} (runtime calls per round: {calls or 'none'})."
        )
    sdpa = records.get(f"sdpa|{name}")
    if sdpa:
        chosen = "; ".join(
            f"{n} tokens: {', '.join(b) or 'no SDPA call'}" for n, b in sdpa.items() if n != "key"
        )
        lines.append(f"SDPA backend of a prefill from an empty cache: {chosen}.")
    prefill = records.get(f"prefill|{name}")
    if prefill:
        lines.append(_prefill_line(prefill))
    return ["", *lines] if lines else []


def _prefill_line(r: dict) -> str:
    head = f"One prefill of {r['tokens']} tokens (target): "
    if not r["fits"]:
        return head + f"**out of memory** ({r.get('error', '')})."
    memory = ""
    if "peak_bytes" in r:
        memory = (
            f", peak {r['peak_bytes'] / 2**30:.1f} GiB of {r['device_bytes'] / 2**30:.0f} "
            f"({r['before_bytes'] / 2**30:.1f} GiB before)"
        )
    return head + f"{r['seconds']:.2f} s{memory}."


def _memory_lines(name: str, hdr: dict, records: dict[str, dict]) -> list[str]:
    kv, resample = records.get(f"kv|{name}"), records.get(f"resample|{name}")
    if not kv or not resample:
        return []
    plan = hdr["plan"]
    n, per = plan["resample_particles"], kv["bytes_per_token"]
    return [
        "",
        f"Resampling {n} particles at {plan['context'] + plan['resample_tokens']} tokens "
        f"(`cache.select`, page tables): {_ms(resample['value'])} ms. KV bytes per token: target "
        f"{per['target']}, draft {per['draft']}. One SMC run (N={n}, K=4, "
        f"{plan['resample_tokens']} new tokens, target + draft): peak "
        f"{kv['paged_peak_bytes'] / 2**20:.1f} MiB in shared pages vs "
        f"{kv['naive_bytes'] / 2**20:.1f} MiB for {n} contiguous caches "
        f"({kv['resamples']} resamples).",
    ]


def _e2e_lines(name: str, hdr: dict, records: dict[str, dict]) -> list[str]:
    runs = [r for k, r in records.items() if k.startswith(f"e2e|{name}|")]
    if not runs:
        return []
    by = {(r["mode"], r["label"]): r for r in runs}
    ar = by.get(("graphs", "ar"), by.get(("eager", "ar"), {})).get("tokens_per_second")
    lines = [
        "",
        "| method | eager tok/s | graphs tok/s | graphs decode tok/s | x ar (graphs) | what | "
        "diagnostics |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in dict.fromkeys(r["label"] for r in runs):
        e, g = by.get(("eager", label), {}), by.get(("graphs", label), {})
        tps = g.get("tokens_per_second")
        what = "measured"
        if label.startswith("sd"):
            what = "measured on random weights: acceptance meaningless"
        lines.append(
            f"| {label} | {_fmt(e.get('tokens_per_second'))} | {_fmt(tps)} | "
            f"{_fmt(g.get('decode_tokens_per_second'))} | {_x(tps / ar if tps and ar else None)} "
            f"| {what} | {_diagnostics(g or e)} |"
        )
    sd = records.get(f"sd-predicted|{name}")
    ar_decode = by.get(("graphs", "ar"), {}).get("decode_tokens_per_second")
    if sd:
        tps = sd["decode_tokens_per_second"]
        lines.append(
            f"| sd K={sd['K']} predicted | - | - | {_fmt(tps)} | "
            f"{_x(tps / ar_decode if ar_decode else None)} (decode) | predicted: "
            f"(1 - a^(K+1)) / (1 - a) = {sd['tokens_per_round']:.2f} tokens per round of "
            f"{_ms(sd['round_ms'])} ms (K draft steps + a verify of K+1, graphs), "
            f"a = {hdr['sd_acceptance']['value']} | - |"
        )
    hf = records.get(f"hf|{name}")
    if hf:
        tps = hf["tokens_per_second"]
        lines.append(
            f"| ar, transformers generate (greedy, eager) | {_fmt(tps)} | - | - | "
            f"{_x(tps / ar if ar else None)} | measured | - |"
        )
    if sd:
        a = hdr["sd_acceptance"]
        lines += [
            "",
            f"a = {a['value']}, the per-token acceptance (accepted drafts / drafts checked, up "
            "to and including the first rejection; a round commits the accepted prefix plus "
            f"the target's own token): {a['source']}.",
        ]
        if name != SD_ACCEPTANCE_PAIR:
            lines[-1] += " Not measured on this pair: assumed."
    return lines


def _checks_report(records: dict[str, dict]) -> list[str]:
    checks = [r for k, r in records.items() if k.startswith("check|")]
    if not checks:
        return []
    lines = [
        "",
        "## Correctness",
        "",
        "| check | max diff | tolerance | result |",
        "|---|---|---|---|",
    ]
    for r in checks:
        diff, tol = r.get("diff"), r.get("tol")
        cells = [f"{diff:.2e}" if diff is not None else "-", f"{tol:.1e}" if tol else "-"]
        served = (
            f" (graphs served {r['replays']} of {r['passes']} passes)" if r.get("passes") else ""
        )
        lines.append(f"| {r['check']}{served} | {cells[0]} | {cells[1]} | {_verdict(r['ok'])} |")
    return lines


def _verdict(ok: bool | None) -> str:
    return {True: "passed", False: "**FAILED**", None: "not run"}[ok]


def _not_run_report(records: dict[str, dict]) -> list[str]:
    """What did not run, and the stages that raised, with their tracebacks."""
    lines = []
    not_run = [r for k, r in records.items() if k.startswith("not-run|")]
    if not_run:
        lines += ["", "## Not run", ""]
        lines += [f"- {r['stage']}: {r['why']}" for r in not_run]
    stages = [r for k, r in records.items() if k.startswith("stage|")]
    if stages:
        lines += [
            "",
            "Seconds per stage: "
            + "; ".join(f"{r['stage']} {r['seconds']:.1f}" for r in stages)
            + ".",
        ]
    crashes = [r for k, r in records.items() if k.startswith("crash|")]
    if crashes:
        lines += ["", "## Stages that raised", ""]
        for r in crashes:
            lines += [f"### {r['stage']}", "", "```", r["traceback"].rstrip(), "```", ""]
    return lines


def _diagnostics(r: dict) -> str:
    if "acceptance_rate" in r:
        return f"acceptance {r['acceptance_rate']:.2f}, {r['rounds']} rounds"
    if r.get("ess"):
        return f"mean ESS {statistics.mean(r['ess']):.2f}, {r['resamples']} resamples"
    return ""


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(value: float | None, planned: bool = False) -> str:
    """Milliseconds; a row that was planned but has no value did not run."""
    if value is None:
        return "not run" if planned else "-"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.4f}"
