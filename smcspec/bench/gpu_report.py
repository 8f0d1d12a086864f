"""The Markdown report of `smcspec bench gpu` (gpu.md), written from gpu.jsonl alone: its
header (`run_header`: machine, device, plan, shapes, the sd acceptance assumed) and one record
per measurement or check."""

from __future__ import annotations

import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from smcspec.bench import machine
from smcspec.bench.gpu_pairs import (
    PAIRS,
    SD_ACCEPTANCE,
    SD_ACCEPTANCE_PAIR,
    SD_ACCEPTANCE_SOURCE,
    GpuPlan,
    load_config,
)
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
    }


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
        f"{machine.one_line(hdr['machine'])}. Random N(0, 0.02) weights of the published "
        "configs, q and k projections 8x larger (peaked attention). Forward passes: a cache "
        f"of {plan['context']} tokens, median of "
        f"{plan['reps']} timings after a warm-up, the device synchronised at each clock read. "
        f"End to end: a prompt of {plan['prompt_tokens']} random tokens, {plan['new_tokens']} "
        f"new tokens (EOS ignored), T={plan['temperature']}, seed {plan['seed']}, one request; "
        "tok/s includes the prefill, decode tok/s does not.",
    ]
    for name in plan["pairs"]:
        lines += _pair_report(name, hdr, records)
    lines += _checks_report(records)
    skipped = records.get("skipped", {}).get("skipped", [])
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    text = "\n".join(lines) + "\n"
    (out / "gpu.md").write_text(text)
    return text


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
    if not eager:
        return [*lines, "", "Not measured (time budget or --only correctness)."]
    lines += ["", "| forward pass (ms) | eager | graphs | eager / graphs |", "|---|---|---|---|"]
    for row, ms in eager.items():
        g = graphs.get(row)
        lines.append(f"| {row} | {_ms(ms)} | {_ms(g)} | {_x(ms / g if g else None)} |")
    floor = records[f"floor|{name}"]
    best = min(v for v in (eager["target step"], graphs.get("target step")) if v)
    lines += [
        "",
        f"Floor of a target step: {floor['weight_bytes'] / 1e9:.2f} GB of weights at "
        f"{floor['copy_bytes_per_s'] / 2e9:.0f} GB/s (half the bytes/s a device-to-device copy "
        f"moves) = {_ms(floor['floor_ms'])} ms; the best step is {best / floor['floor_ms']:.2f}x "
        "the floor.",
    ]
    lines += _memory_lines(name, hdr, records)
    return lines + _e2e_lines(name, hdr, records)


def _memory_lines(name: str, hdr: dict, records: dict[str, dict]) -> list[str]:
    kv, resample = records.get(f"kv|{name}"), records.get(f"resample|{name}")
    if not kv or not resample:
        return []
    plan = hdr["plan"]
    n, per = plan["resample_particles"], kv["bytes_per_token"]
    return [
        "",
        f"Resampling {n} particles at {plan['context'] + plan['resample_tokens']} tokens "
        f"(`cache.select`, page tables): {_ms(resample['ms'])} ms. KV bytes per token: target "
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
    triton = records.get("triton")
    if not checks and not triton:
        return []
    lines = ["", "## Correctness", "", "| check | max diff | tolerance | ok |", "|---|---|---|---|"]
    if triton:
        lines.append(f"| Triton paged attention vs reference (bf16) | - | 2e-2 | {triton['ok']} |")
    for r in checks:
        diff, tol = r.get("diff"), r.get("tol")
        cells = [f"{diff:.2e}" if diff is not None else "-", f"{tol:.1e}" if tol else "-"]
        lines.append(f"| {r['check']} | {cells[0]} | {cells[1]} | {r['ok']} |")
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


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.4f}"
