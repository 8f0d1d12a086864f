"""The probes of `smcspec bench gpu` that look under the engine's speed: the device's read
bandwidth (the floor of a step), a kernel timed alone, the sampler, host syncs per round, the
SDPA backend a prefill lands on, and the memory of a long prefill.

Each probe is one function returning a JSON-able record; `gpu` runs each as a stage. Nothing
here imports the model layer: the kernel under test is passed in."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from smcspec import sampling
from smcspec.bench import machine
from smcspec.bench.gpu.pairs import GpuPlan, Method, generate
from smcspec.engine.llm import LLM

# The runtime calls that make the host wait for the device; a blocking copy is a memcpy
# followed by one of these, so they count each wait once.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


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


def bench_ms(fn: Callable[[], Any], plan: GpuPlan) -> float:
    """Median milliseconds of fn: `triton.testing.do_bench` on CUDA (device events, the L2
    flushed between calls), `timed` elsewhere."""
    if torch.device(plan.device).type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return 1e3 * timed(fn, max(3, plan.reps))


def read_bandwidth(plan: GpuPlan) -> dict[str, float]:
    """Bytes per second a read-only reduction streams (`x.sum()` over plan.bandwidth_bytes of
    float32): what a step that reads each weight once can reach. Half a copy's bytes/s would
    count the copy's writes as if they cost nothing and set the floor 2x too low."""
    g = torch.Generator(device=plan.device).manual_seed(plan.seed)
    x = torch.rand(plan.bandwidth_bytes // 4, generator=g, device=plan.device)  # never zeros
    ms = bench_ms(x.sum, plan)
    nbytes = x.numel() * 4
    del x
    return {"read_bytes": nbytes, "read_ms": ms, "read_bytes_per_s": 1e3 * nbytes / ms}


def step_floor(weight_bytes: int, read_bytes_per_s: float) -> float:
    """Milliseconds a step cannot beat: its weights read once at the device's read bandwidth."""
    return 1e3 * weight_bytes / read_bytes_per_s


# ---- kernels alone --------------------------------------------------------------------------

Kernel = Callable[..., torch.Tensor]  # paged attention: (q, k, v, tables, seq_index, pos, scale)
KernelCase = tuple[int, int, int]  # (sequences, query tokens per sequence, keys per sequence)


def attention_ms(kernel: Kernel, case: KernelCase, heads: tuple[int, int, int], plan: GpuPlan):
    """Median ms of one paged-attention call: `seqs` sequences of `keys` keys each (pages
    shuffled through the pool), the last `tokens` of each as queries; heads (nh, nkv, d)."""
    seqs, tokens, keys = case
    nh, nkv, d = heads
    page_size = 16
    per_seq = -(-keys // page_size)
    g = torch.Generator(device=plan.device).manual_seed(plan.seed)
    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=plan.device).to(dtype)

    k, v = randn(seqs * per_seq, page_size, nkv, d), randn(seqs * per_seq, page_size, nkv, d)
    perm = torch.randperm(seqs * per_seq, generator=g, device=plan.device)
    tables = perm.view(seqs, per_seq).int()  # [seqs, pages]
    q = randn(seqs * tokens, nh, d)  # [T, nh, d]
    dev = plan.device
    seq_index = torch.arange(seqs, dtype=torch.int32, device=dev).repeat_interleave(tokens)
    positions = (keys - tokens + torch.arange(tokens, device=dev)).repeat(seqs)  # [T]
    return bench_ms(lambda: kernel(q, k, v, tables, seq_index, positions, d**-0.5), plan)


def sample_ms(rows: int, vocab: int, plan: GpuPlan) -> float:
    """Median ms of `sampling.sample` on [rows, vocab] log-probs, driven by a CPU generator as
    the decoders' are."""
    g = torch.Generator(device=plan.device).manual_seed(plan.seed)
    logp = torch.randn(rows, vocab, generator=g, device=plan.device).log_softmax(-1)
    draws = torch.Generator().manual_seed(plan.seed)
    return bench_ms(lambda: sampling.sample(logp, draws), plan)


# ---- the host's waits -----------------------------------------------------------------------


def runtime_calls(run: Callable[[], Any]) -> tuple[Any, Counter]:
    """fn's result and how often it called each CUDA runtime function that waits or copies
    (torch.profiler; empty without CUDA)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        out = run()
    return out, Counter(n for n in _event_names(prof) if n.startswith("cuda") and _waits(n))


def _event_names(prof: torch.profiler.profile) -> list[str]:
    """The raw event names: `prof.events()` would build every event's tree first (seconds for
    the ~20k events of a short run)."""
    kineto = getattr(prof.profiler, "kineto_results", None)
    if kineto is None:
        return [e.name for e in prof.events()]
    return [e.name() for e in kineto.events()]


def _waits(name: str) -> bool:
    return "Synchronize" in name or "Memcpy" in name


def syncs_per_round(llm: LLM, prompt: list[int], method: Method, plan: GpuPlan) -> dict:
    """Host syncs per decoding round: the calls of a long run minus those of a short one, over
    the rounds between them, so that the prefill and the set-up cancel out."""
    generate(llm, prompt, method, plan, plan.sync_tokens)  # graphs captured before counting
    runs = [
        runtime_calls(lambda n=n: generate(llm, prompt, method, plan, n))
        for n in (plan.sync_tokens // 2, plan.sync_tokens)
    ]
    (short, few), (long, many) = runs
    rounds = long.diagnostics["rounds"] - short.diagnostics["rounds"]
    if rounds < 1:
        raise RuntimeError(f"{plan.sync_tokens} tokens took no more rounds than half as many")
    calls = {name: (many[name] - few[name]) / rounds for name in many | few}
    return {
        "rounds": rounds,
        "calls_per_round": calls,
        "syncs_per_round": sum(calls.get(name, 0.0) for name in SYNC_CALLS),
    }


# ---- attention backends and memory ----------------------------------------------------------


class SdpaChoices(TorchFunctionMode):
    """Records the backend torch picks for every scaled_dot_product_attention call inside it
    (`torch._fused_sdp_choice` on the call's own arguments), however the caller imported it."""

    def __init__(self) -> None:
        super().__init__()
        self.backends: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.backends.append(sdpa_backend(*args, **kwargs))
        return func(*args, **kwargs)


def sdpa_backend(*args: Any, **kwargs: Any) -> str:
    """The backend torch would pick for these SDPA arguments (or why that is unknown: the
    probe must not fail the call it watches)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(*args, **kwargs)).name.lower()
    except Exception as err:
        return f"unknown ({type(err).__name__}: {err})"


def prefill_backends(llm: LLM, prompts: tuple[int, ...], plan: GpuPlan) -> dict[str, list]:
    """prompt length -> the SDPA backends one prefill of the target used (none: the prefill
    never called SDPA)."""
    out = {}
    lm = llm.target
    g = torch.Generator().manual_seed(plan.seed)
    for n in prompts:
        tokens = torch.randint(0, lm.vocab_size, (1, n), generator=g)
        cache = lm.new_cache()
        with SdpaChoices() as spy, torch.inference_mode():
            lm.forward(tokens, cache, 1)
        cache.release()
        out[str(n)] = sorted(set(spy.backends))
    return out


def long_prefill(llm: LLM, tokens: int, plan: GpuPlan) -> dict[str, Any]:
    """One prefill of `tokens` random tokens through the target: seconds and peak device
    memory, or the out-of-memory error it ended in (a finding, not a crash)."""
    lm = llm.target
    cuda = torch.device(plan.device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    ids = torch.randint(0, lm.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    cache = lm.new_cache()
    record: dict[str, Any] = {"tokens": tokens, "fits": True, "before_bytes": before}
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            lm.forward(ids, cache, 1)
            machine.drain()
            record["seconds"] = time.perf_counter() - start
    except RuntimeError as err:  # torch.OutOfMemoryError, or a library's failed allocation
        if not _out_of_memory(err):
            raise
        record.update(fits=False, error=str(err).splitlines()[0])
    finally:
        cache.release()
    if cuda:
        record["peak_bytes"] = torch.cuda.max_memory_allocated()
        record["device_bytes"] = torch.cuda.get_device_properties(plan.device).total_memory
        torch.cuda.empty_cache()
    return record


def _out_of_memory(err: RuntimeError) -> bool:
    text = str(err).lower()
    return (
        isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text
    )
