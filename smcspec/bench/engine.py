"""`smcspec bench engine`: the engines side by side, in one process, at one precision.

For each backend (native paged engine, transformers): the target's one-token step, the
verification pass at N x (K+1) tokens, the draft step at batch N, the cost of resampling N
particles (page tables vs tensor copies) and end-to-end tokens/s of ar, sd and smc, interleaved
prompt by prompt. On the native engine also the KV memory an SMC run holds at its peak, against
what N contiguous per-particle caches would hold.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from smcspec.bench import machine
from smcspec.bench.contenders import Contender, run
from smcspec.bench.report import _fmt, decode_rate
from smcspec.bench.results import ResultLog, header, machines, measurements
from smcspec.bench.roofline import time_forward
from smcspec.bench.speed import prompt_ids
from smcspec.config import SamplingConfig
from smcspec.engine import start_cache


@dataclass(frozen=True)
class EnginePlan:
    contenders: list[Contender]
    context: int = 150
    verify_rows: tuple[int, ...] = (1, 2, 4, 8)  # N; each row verifies K+1 = 4 tokens
    draft_batches: tuple[int, ...] = (1, 2, 4, 8)
    resample_particles: int = 8
    resample_tokens: int = 256
    prompts: int = 3
    max_new_tokens: int = 64
    temperature: float = SamplingConfig.temperature
    reps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contenders:
            raise ValueError("no methods to run")
        if self.context < 2:
            raise ValueError(f"context must be >= 2, got {self.context}")
        if not 1 <= self.prompts <= 164:
            raise ValueError(f"prompts must be in [1, 164], got {self.prompts}")
        for name in ("max_new_tokens", "reps", "resample_particles", "resample_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


VERIFY_TOKENS = 4  # K + 1 per row in the verification timings


def step_timings(llm, context: list[int], plan: EnginePlan) -> dict[str, float]:
    """Median milliseconds of each forward shape, keyed by a readable name."""
    ms: dict[str, float] = {"target step": 1e3 * time_forward(llm.target, context, 1, 1, plan.reps)}
    for n in plan.verify_rows:
        seconds = time_forward(llm.target, context, n, VERIFY_TOKENS, plan.reps)
        ms[f"verify {n * VERIFY_TOKENS} tokens"] = 1e3 * seconds
    for n in plan.draft_batches:
        ms[f"draft step batch {n}"] = 1e3 * time_forward(llm.draft, context, n, 1, plan.reps)
    return ms


def resample_timing(llm, context: list[int], plan: EnginePlan) -> float:
    """Median milliseconds of one resampling of N particles holding context + resample_tokens
    positions, through the cache's own `select` (page tables, or tensor copies)."""
    n = plan.resample_particles
    length = plan.context + plan.resample_tokens
    ids = (context * (length // len(context) + 1))[:length]
    cache = start_cache(llm.target, torch.tensor(ids), rows=n)
    g = torch.Generator().manual_seed(plan.seed)
    times = []
    for _ in range(plan.reps + 1):
        ancestors = torch.randint(0, n, (n,), generator=g)
        start = time.perf_counter()
        cache.select(ancestors)
        times.append(time.perf_counter() - start)
    cache.release()
    return 1e3 * statistics.median(times[1:])


def kv_memory(llm, prompt: list[int], plan: EnginePlan) -> dict[str, Any]:
    """Peak KV bytes of one SMC run (N particles, resample_tokens new tokens, EOS ignored) on
    the native engine, against N contiguous caches of the same final length."""
    models = (llm.target, llm.draft)
    for m in models:
        m.kv.allocator.reset_peak()
    out = llm.generate(
        prompt,
        "smc",
        particles=plan.resample_particles,
        draft_tokens=4,
        temperature=plan.temperature,
        max_new_tokens=plan.resample_tokens,
        stop_at_eos=False,
        seed=plan.seed,
        chat=False,
    )
    paged = sum(m.kv.kv_bytes_peak() for m in models)
    positions = len(prompt) + plan.resample_tokens
    naive = sum(plan.resample_particles * positions * m.kv.bytes_per_token for m in models)
    return {
        "paged_peak_bytes": paged,
        "naive_bytes": naive,
        "saving": 1 - paged / naive,
        "resamples": out.diagnostics["resamples"],
        "rounds": out.diagnostics["rounds"],
        "resample_seconds": out.diagnostics["time_split"]["resample"],
    }


def run_engine(llms: dict[str, Any], plan: EnginePlan, out_dir: str | Path) -> str:
    """llms: backend name -> LLM, all at the same precision. Writes engine.jsonl / engine.md."""
    out = Path(out_dir)
    first = next(iter(llms.values()))
    hdr = machine.run_header(first, f"{first.dtype}", plan)
    hdr["backends"] = list(llms)
    log = ResultLog(out / "engine.jsonl", hdr)
    prompts = prompt_ids(first, plan.prompts)
    context = (prompts[0] * (plan.context // len(prompts[0]) + 1))[: plan.context]
    for name, llm in llms.items():
        if not log.has(f"steps|{name}"):
            log.add(f"steps|{name}", {"backend": name, "ms": step_timings(llm, context, plan)})
        if not log.has(f"resample|{name}"):
            ms = resample_timing(llm, context, plan)
            log.add(f"resample|{name}", {"backend": name, "ms": ms})
        if name == "native" and not log.has("kv|native"):
            log.add("kv|native", {"backend": name, **kv_memory(llm, prompts[0], plan)})
    jobs = [(i, name, c) for i in range(len(prompts)) for name in llms for c in plan.contenders]
    todo = [j for j in jobs if not log.has(_key(plan, *j))]
    if todo:  # an untimed warm-up of every method on every engine
        for llm in llms.values():
            for c in plan.contenders:
                run(llm, c, prompts[0], plan.temperature, 4, False, 0)
    for i, name, c in tqdm(todo, desc="bench engine", unit="run"):
        result = run(llms[name], c, prompts[i], plan.temperature, plan.max_new_tokens, False, i)
        for drop in ("text", "particle_texts", "token_ids"):
            result.pop(drop, None)
        log.add(_key(plan, i, name, c), {"backend": name, "label": c.label, **result})
    return write_engine_report(out)


def _key(plan: EnginePlan, prompt: int, backend: str, c: Contender) -> str:
    return f"e2e|{backend}|{c.label}|prompt={prompt}|T={plan.temperature}|len={plan.max_new_tokens}"


def write_engine_report(out_dir: str | Path) -> str:
    out = Path(out_dir)
    path = out / "engine.jsonl"
    records, hdr = measurements(path), header(path)
    backends = hdr.get("backends", [])
    plan = hdr.get("plan", {})
    lines = [
        f"Engines at {hdr['machine']['precision']}: {machine.ran_on(machines(path))}; "
        f"target {hdr['models']['target']}, draft {hdr['models']['draft']}; "
        f"context {plan.get('context')} tokens, median of {plan.get('reps')} reps.",
        "",
        "| forward pass (ms) | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    steps = {r["backend"]: r["ms"] for r in records if r["key"].startswith("steps|")}
    resample = {r["backend"]: r["ms"] for r in records if r["key"].startswith("resample|")}
    names = list(next(iter(steps.values()), {}))
    for row in names:
        cells = [_ms(steps.get(b, {}).get(row)) for b in backends]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    n, extra = plan.get("resample_particles"), plan.get("resample_tokens")
    lines.append(
        f"| resample {n} particles at {plan.get('context', 0) + extra} tokens | "
        + " | ".join(_ms(resample.get(b)) for b in backends)
        + " |"
    )
    lines += _e2e_table(records, backends, plan)
    kv = next((r for r in records if r["key"] == "kv|native"), None)
    if kv:
        lines += [
            "",
            f"KV memory of one SMC run on the native engine (N={n}, K=4, {extra} new tokens, "
            f"target + draft): peak {kv['paged_peak_bytes'] / 2**20:.1f} MiB in shared pages vs "
            f"{kv['naive_bytes'] / 2**20:.1f} MiB for {n} contiguous caches "
            f"({100 * kv['saving']:.1f}% less); {kv['resamples']} resamples in {kv['rounds']} "
            f"rounds took {1e3 * kv['resample_seconds']:.1f} ms in all.",
        ]
    text = "\n".join(lines) + "\n"
    (out / "engine.md").write_text(text)
    return text


def _e2e_table(records: list[dict], backends: list[str], plan: dict) -> list[str]:
    e2e = [r for r in records if r["key"].startswith("e2e|")]
    if not e2e:
        return []
    labels = list(dict.fromkeys(r["label"] for r in e2e))

    def mean(backend: str, label: str, decode_only: bool) -> float | None:
        rs = [r for r in e2e if r["backend"] == backend and r["label"] == label]
        if not rs:
            return None
        if decode_only:  # new tokens over the time after the prompt's prefill
            return statistics.mean(decode_rate(r) for r in rs)
        return statistics.mean(r["tokens_per_second"] for r in rs)

    lines = [
        "",
        f"End to end: first {plan.get('prompts')} HumanEval prompts as chat messages (as plain "
        "text for a model without a chat template), "
        f"{plan.get('max_new_tokens')} new tokens (EOS ignored), T={plan.get('temperature')}. "
        "tok/s = new tokens / wall time including the prompt's prefill; decode = the same "
        "without the prefill; x = speed-up over ar in the same engine.",
        "",
        "| method | "
        + " | ".join(f"{b} tok/s | {b} x | {b} decode tok/s | {b} decode x" for b in backends)
        + " | diagnostics |",
        "|---|" + "---|---|---|---|" * len(backends) + "---|",
    ]
    for label in labels:
        cells = []
        for b in backends:
            for decode_only in (False, True):
                tps, ar = mean(b, label, decode_only), mean(b, "ar", decode_only)
                cells += [_fmt(tps), _fmt(tps / ar if tps and ar else None)]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_diagnostics(e2e, label)} |")
    return lines


def _diagnostics(records: list[dict], label: str) -> str:
    rs = [r for r in records if r["label"] == label and r["backend"] == records[0]["backend"]]
    if label.startswith("sd"):
        return f"acceptance {statistics.mean(r['acceptance_rate'] for r in rs):.2f}"
    if label.startswith("smc"):
        ess = [statistics.mean(r["ess"]) for r in rs if r.get("ess")]
        rate = sum(r["resamples"] for r in rs) / max(1, sum(r["rounds"] for r in rs))
        return f"mean ESS {statistics.mean(ess):.2f}, resample rate {rate:.2f}"
    return ""


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 1 else f"{value:.3f}"
