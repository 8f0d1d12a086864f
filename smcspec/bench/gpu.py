"""`smcspec bench gpu`: the native engine on one accelerator, with random weights of real shapes.

The pairs (`gpu_pairs`) are built from the published config.json files with random weights
made on the device. For each pair, eager steps and CUDA-graph replays side by side: the
target's one-token step against its bytes/bandwidth floor, verification at N x (K+1) rows, the
draft step at batch N, resampling by page tables, KV bytes, and end-to-end tokens/s of ar, sd
and smc (with transformers' own `generate` for ar).

SD's speed depends on its acceptance, which random weights make meaningless; it is reported both
as measured here and as predicted from this device's step costs with the acceptance measured on
the real pair (`SD_ACCEPTANCE`). SMC commits K+1 tokens every round whatever the weights.

`run_all` runs the correctness checks (`gpu_checks`) and the bench, and writes the report
(`gpu_report`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from smcspec.bench import machine
from smcspec.bench.engine import resample_timing
from smcspec.bench.gpu_checks import check_correctness, check_triton, correctness
from smcspec.bench.gpu_pairs import (
    PAIRS,
    ROLES,
    SD_ACCEPTANCE,
    GpuPlan,
    Method,
    Pair,
    build_pair,
    generate,
    hf_model,
    label,
    pair_llm,
    replays,
)
from smcspec.bench.gpu_report import run_header, write_report
from smcspec.bench.results import ResultLog
from smcspec.bench.roofline import time_forward
from smcspec.engine.llm import LLM
from smcspec.models.llama import LlamaConfig

__all__ = [  # the names callers imported from here before the split
    "PAIRS",
    "GpuPlan",
    "Outcome",
    "build_pair",
    "check_correctness",
    "run_all",
]


# ---- timing ---------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `reps` calls of fn after one untimed warm-up, the GPU drained before
    each clock read (`machine.drain`)."""
    fn()
    times = []
    for _ in range(reps):
        machine.drain()
        start = time.perf_counter()
        fn()
        machine.drain()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int, reps: int) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once, written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), max(3, reps))
    return 2 * nbytes / seconds


def weight_bytes(config: LlamaConfig, dtype: str) -> int:
    """Bytes a one-token step must read: every linear layer and the LM head (the embedding is
    only gathered a row at a time; norms and biases are negligible). The head counts whether or
    not it is tied to the embedding: every step reads all of it."""
    c = config
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * (attention + mlp) + c.vocab_size * c.hidden_size
    return params * (2 if dtype == "bfloat16" else 4)


# ---- the bench ------------------------------------------------------------------------------


def step_ms(llm: LLM, context: list[int], plan: GpuPlan) -> dict[str, float]:
    """Median milliseconds of each forward shape the decoders use."""
    ms = {"target step": 1e3 * time_forward(llm.target, context, 1, 1, plan.reps)}
    for n, t in plan.verify:
        ms[f"verify {n}x{t}"] = 1e3 * time_forward(llm.target, context, n, t, plan.reps)
    for n in plan.draft_batches:
        ms[f"draft step batch {n}"] = 1e3 * time_forward(llm.draft, context, n, 1, plan.reps)
    return ms


def round_ms(llm: LLM, context: list[int], plan: GpuPlan, n: int, k: int) -> float:
    """One speculative round: K draft steps at batch N and a verification of N x (K+1)."""
    draft = time_forward(llm.draft, context, n, 1, plan.reps)
    return 1e3 * (k * draft + time_forward(llm.target, context, n, k + 1, plan.reps))


def kv_memory(llm: LLM, prompt: list[int], plan: GpuPlan) -> dict[str, Any]:
    """KV bytes per token of each model, and the peak of one SMC run (N particles)."""
    models = (llm.target, llm.draft)
    for m in models:
        m.kv.allocator.reset_peak()
    out = generate(llm, prompt, ("smc", plan.resample_particles, 4), plan, plan.resample_tokens)
    positions = len(prompt) + plan.resample_tokens
    return {
        "bytes_per_token": {
            "target": llm.target.kv.bytes_per_token,
            "draft": llm.draft.kv.bytes_per_token,
        },
        "paged_peak_bytes": sum(m.kv.kv_bytes_peak() for m in models),
        "naive_bytes": sum(
            plan.resample_particles * positions * m.kv.bytes_per_token for m in models
        ),
        "resamples": out.diagnostics["resamples"],
    }


def e2e(llm: LLM, prompt: list[int], method: Method, plan: GpuPlan) -> dict[str, Any]:
    """tokens/s of one run (after an untimed short one), with and without the prefill."""
    generate(llm, prompt, method, plan, 4)
    d = generate(llm, prompt, method, plan, plan.new_tokens).diagnostics
    decode = d["seconds"] - d["time_split"]["prefill"]
    keep = ("acceptance_rate", "ess", "resamples", "rounds")
    return {
        "tokens_per_second": d["tokens_per_second"],
        "decode_tokens_per_second": d["new_tokens"] / decode,
        **{key: d[key] for key in keep if key in d},
    }


def hf_generate(hf: Any, prompt: list[int], plan: GpuPlan) -> dict[str, float]:
    """transformers' own eager greedy `generate`, EOS held off: new tokens per second."""
    ids = torch.tensor([prompt], device=plan.device)
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def run(n: int) -> None:
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    run(4)
    seconds = timed(lambda: run(plan.new_tokens), 1)
    return {"tokens_per_second": plan.new_tokens / seconds}


def run_pair(pair: Pair, plan: GpuPlan, log: ResultLog, deadline: float) -> list[str]:
    """Every measurement of one pair into `log`; returns what the deadline made it skip."""
    g = torch.Generator().manual_seed(plan.seed)
    vocab = pair.configs["target"]["vocab_size"]
    context = torch.randint(0, vocab, (plan.context,), generator=g).tolist()
    prompt = context[: plan.prompt_tokens]
    log.add(f"floor|{pair.name}", {"pair": pair.name, **step_floor(pair.target.config, plan)})
    skipped: list[str] = []
    for graphs in (False, True):
        mode = "graphs" if graphs else "eager"
        llm = pair_llm(pair, graphs, plan)
        steps = {"pair": pair.name, "mode": mode, "ms": step_ms(llm, context, plan)}
        log.add(f"steps|{pair.name}|{mode}", steps)
        if graphs:  # the engine as it runs on a GPU
            # bench engine's timing: its plan fields are this plan's
            log.add(f"resample|{pair.name}", {"ms": resample_timing(llm, context, plan)})
            log.add(f"kv|{pair.name}", kv_memory(llm, prompt, plan))
            log.add(f"sd-predicted|{pair.name}", sd_predicted(llm, context, plan))
        for method in plan.methods:
            key = f"e2e|{pair.name}|{mode}|{label(method)}"
            if time.monotonic() > deadline:
                skipped.append(f"{pair.name} {mode} {label(method)} (time budget)")
                continue
            log.add(key, {"mode": mode, "label": label(method), **e2e(llm, prompt, method, plan)})
        log.add(f"replays|{pair.name}|{mode}", {"replays": replays(llm)})
    if time.monotonic() > deadline:
        return [*skipped, f"{pair.name} transformers generate (time budget)"]
    log.add(f"hf|{pair.name}", hf_generate(hf_model(pair, "target", plan), prompt, plan))
    return skipped


def step_floor(config: LlamaConfig, plan: GpuPlan) -> dict[str, float]:
    """A target step cannot beat reading its weights once at the device's copy bandwidth."""
    moved = copy_bandwidth(plan.device, plan.copy_bytes, plan.reps)  # read + write bytes/s
    nbytes = weight_bytes(config, plan.dtype)
    return {"copy_bytes_per_s": moved, "weight_bytes": nbytes, "floor_ms": 2e3 * nbytes / moved}


def sd_predicted(llm: LLM, context: list[int], plan: GpuPlan) -> dict[str, float]:
    """SD's decode speed from this device's step costs and the real pair's acceptance:
    `sd_tokens_per_round` tokens per round of K draft steps and a verification of K+1 (the
    roofline's measured-cost model, one row)."""
    k = next((m[2] for m in plan.methods if m[0] == "sd"), 4)
    ms = round_ms(llm, context, plan, 1, k)
    tokens = sd_tokens_per_round(SD_ACCEPTANCE, k)
    return {
        "K": k,
        "round_ms": ms,
        "tokens_per_round": tokens,
        "decode_tokens_per_second": 1e3 * tokens / ms,
    }


def sd_tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens an SD round with K drafts commits when each draft is accepted with
    probability alpha, independently (Leviathan et al. 2023, eq. 1):

        E = sum_{i=0..K} alpha^i = (1 - alpha^(K+1)) / (1 - alpha)

    the accepted prefix plus the target's own token (the correction at the first rejection, or
    the bonus token after K acceptances). alpha is the per-token acceptance, accepted drafts /
    drafts checked up to and including the first rejection, as `SpeculativeDecoder` reports it;
    alpha * K + 1 would overcount, as if every draft were checked."""
    if alpha == 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class Outcome:
    failures: list[str]  # correctness checks that failed
    skipped: list[str]  # what the time budget left out
    report: str  # the Markdown written to gpu.md


def run_all(
    plan: GpuPlan, out_dir: str | Path, only: str | None = None, budget_s: float | None = None
) -> Outcome:
    """The Triton check (on CUDA), then per pair: build, `correctness` (only="correctness"),
    the bench (only="bench"), free. Writes gpu.jsonl (afresh) and gpu.md to out_dir."""
    deadline = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    path = Path(out_dir) / "gpu.jsonl"
    path.unlink(missing_ok=True)
    log = ResultLog(path, run_header(plan))
    failures, skipped = [], []
    if only != "bench" and torch.device(plan.device).type == "cuda":
        failures += check_triton(plan.device, plan.seed)
        log.add("triton", {"ok": not failures, "failures": failures})
    checked: set[str] = set()  # a model shared by two pairs is checked once
    for name in plan.pairs:
        if time.monotonic() > deadline:
            skipped.append(f"{name}: everything (time budget)")
            continue
        pair = build_pair(plan, name)
        if only != "bench":
            models = dict(zip(ROLES, PAIRS[name], strict=True))
            roles = tuple(r for r in ROLES if models[r] not in checked)
            checked |= set(PAIRS[name])
            for row in correctness(pair, plan, roles):
                log.add(f"check|{row['check']}", row)
                failures += [] if row["ok"] else [row["failure"]]
        if only != "correctness":
            skipped += run_pair(pair, plan, log, deadline)
        del pair
        _free(plan.device)
    log.add("skipped", {"skipped": skipped})
    return Outcome(failures, skipped, write_report(out_dir))


def _free(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
