"""`smcspec bench gpu`: the native engine on one accelerator, with random weights of real shapes.

The pairs (`gpu.pairs`) are built from the published config.json files with random weights
made on the device. For each pair, eager steps and CUDA-graph replays side by side: the
target's one-token step against its bytes / read-bandwidth floor, verification at N x (K+1)
rows, steps at long contexts, the draft step at batch 1..8, resampling by page tables, KV bytes,
host syncs per round, a long prefill's memory, and end-to-end tokens/s of ar, sd and smc (with
transformers' own `generate` for ar); alone, the paged-attention kernel and the sampler.

SD's speed depends on its acceptance, which random weights make meaningless; it is reported both
as measured here and as predicted from this device's step costs with the acceptance measured on
the real pair (`SD_ACCEPTANCE`). SMC commits K+1 tokens every round whatever the weights.

`run_all` runs it as stages (`Run`): the correctness checks (`gpu.checks`, in
`plan.check_dtype`) first, then the probes (`gpu.probes`) and the bench. A stage that raises
leaves its traceback in the report and the run goes on; what the time budget leaves out is
reported as not run; gpu.md (`gpu.report`) is rewritten after every stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from smcspec.bench.engine import resample_timing
from smcspec.bench.gpu import probes
from smcspec.bench.gpu.checks import (
    check_triton,
    graphs_vs_eager,
    native_vs_transformers,
    one_token,
    scheduler_batch,
)
from smcspec.bench.gpu.pairs import (
    PAIRS,
    ROLES,
    SD_ACCEPTANCE,
    Deadline,
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
from smcspec.bench.gpu.probes import timed
from smcspec.bench.gpu.stages import BAD_OPTIONS, CRASHED, Outcome, Run
from smcspec.bench.roofline import time_forward
from smcspec.engine.llm import LLM
from smcspec.models import paged_attention
from smcspec.models.llama import LlamaConfig

__all__ = [  # the names callers import from here
    "BAD_OPTIONS",
    "CRASHED",
    "PAIRS",
    "GpuPlan",
    "Outcome",
    "build_pair",
    "run_all",
    "sd_tokens_per_round",
    "timed",
    "weight_bytes",
]

SYNC_METHODS = (("sd", 1, 4), ("smc", 8, 8))  # host syncs counted for these (the targets')


# ---- one pair's measurements ----------------------------------------------------------------


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


def step_ms(llm: LLM, context: list[int], plan: GpuPlan, deadline: Deadline) -> dict:
    """Median milliseconds of each forward shape the decoders use; None for the shapes the
    deadline left out."""
    shapes = [("target step", llm.target, 1, 1)]
    shapes += [(f"verify {n}x{t}", llm.target, n, t) for n, t in plan.verify]
    shapes += [(f"draft step batch {n}", llm.draft, n, 1) for n in plan.draft_batches]
    return {
        row: None if deadline.passed() else 1e3 * time_forward(lm, context, n, t, plan.reps)
        for row, lm, n, t in shapes
    }


def long_context_ms(llm: LLM, plan: GpuPlan, deadline: Deadline) -> dict:
    """At each of plan.long_contexts keys: a one-token target step and an 8 x 9 verify."""
    g = torch.Generator().manual_seed(plan.seed + 4)
    out: dict[str, float | None] = {}
    for length in plan.long_contexts:
        context = torch.randint(0, llm.target.vocab_size, (length,), generator=g).tolist()
        for row, n, t in (("target step", 1, 1), ("verify 8x9", 8, 9)):
            skip = deadline.passed()
            ms = None if skip else 1e3 * time_forward(llm.target, context, n, t, plan.reps)
            out[f"{row} at {length}"] = ms
    return out


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


def hf_generate(pair: Pair, prompt: list[int], plan: GpuPlan) -> dict[str, float]:
    """transformers' own eager greedy `generate` of the target, EOS held off: new tokens per
    second."""
    hf = hf_model(pair, "target", plan)
    ids = torch.tensor([prompt], device=plan.device)
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def run(n: int) -> None:
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    run(4)
    seconds = timed(lambda: run(plan.new_tokens), 1)
    return {"tokens_per_second": plan.new_tokens / seconds}


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


# ---- a run: stages --------------------------------------------------------------------------


def run_all(
    plan: GpuPlan, out_dir: str | Path, only: str | None = None, budget_s: float | None = None
) -> Outcome:
    """The correctness checks (only="correctness"), then the probes and the bench
    (only="bench"), each part a stage; gpu.jsonl (afresh) and gpu.md in out_dir. `budget_s`
    seconds from now, stages and the rows inside step grids stop starting."""
    run = Run(plan, out_dir, Deadline.after(budget_s))
    try:
        if only != "bench":
            check_all(run)
        if only != "correctness":
            bench_all(run)
    finally:
        run.log.add("skipped", {"skipped": run.unchecked + run.skipped})
        run.write()
    skipped = run.unchecked + run.skipped
    return Outcome(run.failures, skipped, run.report, run.crashed, run.unchecked)


def check_all(run: Run) -> None:
    """The Triton kernel (on CUDA), then per pair, built in plan.check_dtype: native against
    transformers (each model once), graphs against eager, the scheduler, one new token."""
    plan = dataclasses.replace(
        run.plan, dtype=run.plan.check_dtype, qk_scale=run.plan.check_qk_scale
    )
    if torch.device(plan.device).type == "cuda":
        run.checks("triton kernel vs reference", check_triton, plan.device, plan.seed)
    checked: set[str] = set()  # a model shared by two pairs is checked once
    for name in plan.pairs:
        models = dict(zip(ROLES, PAIRS[name], strict=True))
        roles = tuple(r for r in ROLES if models[r] not in checked)
        checked |= set(PAIRS[name])
        pair = run.stage(
            f"{name}: build for the checks ({plan.dtype})", build_pair, plan, name, checks=True
        )
        parts: list[tuple[str, Callable[..., list[dict]], tuple]] = [
            *(
                (f"{name} {role} vs transformers", native_vs_transformers, (role,))
                for role in roles
            ),
            (f"{name} graphs vs eager", graphs_vs_eager, (run.deadline,)),
            (f"{name} scheduler", scheduler_batch, ()),
            (f"{name} one new token", one_token, ()),
        ]
        for stage, fn, args in parts:
            if pair is None:
                run.not_run(stage, _why_not_built(run), checks=True)
            else:
                run.checks(stage, fn, pair, plan, *args)
        del pair
        _free(plan.device)


def bench_all(run: Run) -> None:
    """The read bandwidth, the kernel and the sampler alone, then each pair's bench."""
    plan = run.plan
    bandwidth = run.record("bandwidth", "read bandwidth", probes.read_bandwidth, plan)
    kernel = run.record("kernel", "paged attention alone", kernel_ms, plan, run.deadline)
    run.not_run_rows("paged attention alone", (kernel or {}).get("ms", {}))
    rows, vocab = plan.sample_shape
    run.record("sample", "sampling.sample alone", probes.sample_ms, rows, vocab, plan)
    for name in plan.pairs:
        bench_pair(run, name, bandwidth)
        _free(plan.device)


def kernel_ms(plan: GpuPlan, deadline: Deadline) -> dict:
    """`triton_attention` alone on each of plan.kernel_cases (the paged reference off CUDA)."""
    cuda = torch.device(plan.device).type == "cuda"
    kernel = paged_attention.triton_attention if cuda else paged_attention.reference
    ms = {
        _case(c): None
        if deadline.passed()
        else probes.attention_ms(kernel, c, plan.kernel_heads, plan)
        for c in plan.kernel_cases
    }
    return {"kernel": kernel.__name__, "heads": list(plan.kernel_heads), "ms": ms}


def _case(case: tuple[int, int, int]) -> str:
    seqs, tokens, keys = case
    return f"{seqs} x {tokens} at {keys}"


def bench_pair(run: Run, name: str, bandwidth: dict | None) -> None:
    plan = run.plan
    pair = run.stage(f"{name}: build for the bench ({plan.dtype})", build_pair, plan, name)
    if pair is None:
        run.not_run(f"{name}: bench", _why_not_built(run))
        return
    g = torch.Generator().manual_seed(plan.seed)
    vocab = pair.configs["target"]["vocab_size"]
    context = torch.randint(0, vocab, (plan.context,), generator=g).tolist()
    prompt = context[: plan.prompt_tokens]
    c = pair.target.config
    shape = {"heads": [c.num_heads, c.num_kv_heads, c.head_dim], "layers": c.num_layers}
    nbytes = weight_bytes(c, plan.dtype)
    floor = {"pair": name, "weight_bytes": nbytes, **shape}
    if bandwidth is not None:
        floor |= {**bandwidth, "floor_ms": probes.step_floor(nbytes, bandwidth["read_bytes_per_s"])}
    run.log.add(f"floor|{name}", floor)
    for graphs in (True, False):  # the engine as it runs on a GPU first, should time run out
        mode = "graphs" if graphs else "eager"
        llm = run.stage(f"{name} {mode}: engine", pair_llm, pair, graphs, plan)
        if llm is None:
            continue
        steps = run.stage(f"{name} {mode}: step grid", step_ms, llm, context, plan, run.deadline)
        if steps is not None:
            run.log.add(f"steps|{name}|{mode}", {"pair": name, "mode": mode, "ms": steps})
            run.not_run_rows(f"{name} {mode}", steps)
        if graphs:
            _graph_probes(run, name, llm, context, prompt)
        for method in plan.methods:
            key = f"e2e|{name}|{mode}|{label(method)}"
            record = run.stage(f"{name} {mode}: {label(method)}", e2e, llm, prompt, method, plan)
            if record is not None:
                run.log.add(key, {"mode": mode, "label": label(method), **record})
        run.log.add(f"replays|{name}|{mode}", {"replays": replays(llm)})
        del llm
    run.record(f"hf|{name}", f"{name}: transformers generate", hf_generate, pair, prompt, plan)


def _graph_probes(run: Run, name: str, llm: LLM, context: list[int], prompt: list[int]) -> None:
    plan = run.plan
    what = f"{name}: long-context steps"
    long = run.record(f"long|{name}", what, long_context_ms, llm, plan, run.deadline)
    run.not_run_rows(name, long or {})
    # bench engine's timing: its plan fields are this plan's
    run.record(f"resample|{name}", f"{name}: resampling", resample_timing, llm, context, plan)
    run.record(f"kv|{name}", f"{name}: KV memory", kv_memory, llm, prompt, plan)
    run.record(f"sd-predicted|{name}", f"{name}: sd predicted", sd_predicted, llm, context, plan)
    for method in (m for m in plan.methods if m in SYNC_METHODS):
        key, what = f"syncs|{name}|{label(method)}", f"{name}: syncs per round, {label(method)}"
        run.record(key, what, probes.syncs_per_round, llm, prompt, method, plan)
    run.record(
        f"sdpa|{name}",
        f"{name}: SDPA backends",
        probes.prefill_backends,
        llm,
        plan.prefill_prompts,
        plan,
    )
    run.record(
        f"prefill|{name}", f"{name}: long prefill", probes.long_prefill, llm, plan.long_prompt, plan
    )


def _why_not_built(run: Run) -> str:
    return "time budget" if run.deadline.passed() else "the pair's build raised"


def _free(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
