"""The engine's Triton kernels compiled ahead of time for a GPU this machine does not have.

Triton lowers a kernel TTIR -> TTGIR -> LLVM IR -> PTX in-process and assembles the PTX with
the ptxas its wheel bundles, for any target it is given, so a CPU-only machine can check what
the interpreter (TRITON_INTERPRET=1) never does: that a kernel compiles for sm_90 at the shapes
the engine launches it with, and how many registers, spills and how much shared memory it
needs. What is compiled is exactly what the JIT would build on the GPU: a kernel's public Python
wrapper is called with CPU tensors laid out as the engine lays them out, its launches are
recorded instead of run (`intercept`), and Triton's own binder turns each recorded launch into
the signature, constexprs and divisibility attributes the JIT would specialize on
(`compile_launch`). A wrapper that tells the interpreter from the tensors' device sets a few
constexprs for the CPU; `GPU_CONSTEXPRS` gives them the GPU's values.

A `Case` names one engine shape (model, dtype, page size, table width, launch kind) and makes
its wrapper calls; every launch the wrappers make is compiled, so a new kernel behind an
existing wrapper needs no change here, and a new wrapper needs only a new case builder.

Run it in a process without TRITON_INTERPRET: `triton.jit` picks the interpreter when it
decorates, so a process that set the switch holds no compilable kernels.
"""

from __future__ import annotations

import io
import itertools
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from smcspec.kv.cache import PagedKVCache
from smcspec.models.attention import ForwardBatch, PagedAttention

HOPPER = 90  # H100 / H200


@dataclass(frozen=True)
class Launch:
    """One recorded `kernel[grid](*args, **kwargs)`."""

    kernel: Any  # triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)


@dataclass(frozen=True)
class Usage:
    """What ptxas made of one launch for sm_`arch`, per thread: `spill_bytes` are the stores of
    values the registers could not hold (0 unless they ran out); `cp_async` says the loads are
    software-pipelined (asynchronous copies into shared memory)."""

    case: str
    kernel: str
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    ctas_per_sm: int  # resident at once, as registers, shared memory and warps allow
    cp_async: bool
    constexprs: str
    seconds: float


@dataclass(frozen=True)
class Failure:
    """A launch Triton or ptxas refused for the GPU (a kernel only the interpreter accepts)."""

    case: str
    kernel: str
    error: str


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


QWEN_05B = Model("qwen2.5-0.5b", 14, 2, 64, 896, 4864)
QWEN_15B = Model("qwen2.5-1.5b", 12, 2, 128, 1536, 8960)
QWEN_7B = Model("qwen2.5-7b", 28, 4, 128, 3584, 18944)
MODELS = (QWEN_05B, QWEN_15B, QWEN_7B)


@dataclass(frozen=True)
class Kind:
    """A launch kind: `rows` sequences appending `tokens` each, the last at position
    `context` - 1; `max_query_len` (ForwardBatch's) None: `tokens`, as an eager batch's."""

    name: str
    rows: int
    tokens: int
    context: int
    max_query_len: int | None = None


DECODE_1 = Kind("decode 1x1", 1, 1, 512)
DECODE = Kind("decode 8x1", 8, 1, 512)
# A CUDA graph's flat batch of a 96-token bucket (graphs.py): as many rows as tokens, padding
# rows included. Its row and token counts divide by 16, which the JIT specializes on. The
# bucket's steps graph (rows of <= 2 tokens: 12 draft steps of 8 rows) plans the decode tile,
# its verify graph (a verify 8x9 padded) the verify's: the same shapes, other constexprs.
GRAPH_96 = Kind("graph 96x1", 96, 1, 512, max_query_len=2)
GRAPH_96_VERIFY = Kind("graph verify 96x1", 96, 1, 512, max_query_len=16)
VERIFY = Kind("verify 8x9", 8, 9, 512)
PREFILL = Kind("prefill 1x256", 1, 256, 1024)  # a scheduler chunk over a cached prefix
KINDS = (DECODE_1, DECODE, GRAPH_96, GRAPH_96_VERIFY, VERIFY, PREFILL)

GRAPH_WIDTH = 2048  # a graph's static table: 32768 positions of 16-token pages
EAGER_WIDTH = 33  # an eager table of a ragged width (the JIT specializes on stride % 16)


@dataclass(frozen=True)
class Case:
    wrapper: str  # a key of WRAPPERS
    model: Model
    dtype: torch.dtype
    kind: Kind
    page_size: int = 16
    width: int = GRAPH_WIDTH

    @property
    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        pages = f" page {self.page_size} width {self.width}" if self.wrapper in PAGED else ""
        return f"{self.wrapper} {self.model.name} {dtype}{pages} {self.kind.name}"


# -- capture -------------------------------------------------------------------------------


@contextmanager
def intercept() -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block instead of running it. The launch is
    Triton's own entry (`JITFunction.run`), so whatever kernels a wrapper launches, in
    whatever order, are seen; nothing runs, so CPU tensors stand in for the GPU's."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(kernel, _grid(kernel, grid, args, kwargs), args, kwargs))

    run = JITFunction.run
    JITFunction.run = record  # the only way in without a GPU driver: restored below
    try:
        yield launches
    finally:
        JITFunction.run = run


def _grid(kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    if callable(grid):
        names = {p.name for p in kernel.params}
        bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        grid = grid(dict(bound.arguments))
    return tuple(int(g) for g in grid)


# Constexprs a wrapper sets for Triton's interpreter only: the GPU's values, whatever the
# environment the launches are recorded in. paged_attention's DOT_FP32 casts tl.dot's operands to
# float32, which the interpreter needs and the GPU must not get (no bf16 tensor cores).
GPU_CONSTEXPRS = {"DOT_FP32": False}


def capture(case: Case) -> list[Launch]:
    """The launches `case`'s wrapper makes, recorded, not run, with the GPU's constexprs."""
    with intercept() as launches:
        WRAPPERS[case.wrapper](case)
    if not launches:
        raise RuntimeError(f"{case.label}: the wrapper launched no Triton kernel")
    if any(type(x.kernel).__name__ != "JITFunction" for x in launches):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): nothing to compile")
    return [
        replace(
            x, kwargs={**x.kwargs, **{k: v for k, v in GPU_CONSTEXPRS.items() if k in x.kwargs}}
        )
        for x in launches
    ]


# -- compile -------------------------------------------------------------------------------


def missing_tools() -> str | None:
    """Why this machine cannot compile for the GPU, or None if it can."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return None if ptxas.is_file() else f"Triton's bundled ptxas is missing ({ptxas})"


@dataclass(frozen=True)
class _Specialized:
    """A launch as the JIT sees it: the signature, constexprs, divisibility attributes and
    options it compiles for. Two launches with equal `key`s are one GPU binary."""

    source: Any  # triton.compiler.ASTSource
    options: Any
    key: str


def _specialize(launch: Launch, target: Any) -> _Specialized:
    """Triton's own binder, the one `JITFunction.run` uses, on the recorded arguments."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, backend = launch.kernel, make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, spec, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    key = repr((kernel.module, kernel.__name__, spec, sorted(options.__dict__.items())))
    return _Specialized(source, options, key)


def compile_launch(case: str, launch: Launch, arch: int = HOPPER) -> Usage | Failure:
    """Compile `launch` as the JIT would on an sm_`arch` device."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    return _compile_specialized(case, launch, _specialize(launch, target), target)


def _compile_specialized(
    case: str, launch: Launch, spec: _Specialized, target: Any
) -> Usage | Failure:
    name, start = launch.kernel.__name__, time.perf_counter()
    try:
        compiled, log = _compile(spec.source, target, spec.options)
    except Exception as e:  # any refusal (frontend, LLVM, ptxas) is the finding
        return Failure(case, name, f"{type(e).__name__}: {e}"[-2000:])
    seconds = time.perf_counter() - start
    arg_names = launch.kernel.arg_names
    constexprs = spec.source.constants.items()
    resources = _resources(log)
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    return Usage(
        case=case,
        kernel=name,
        grid=launch.grid,
        num_warps=warps,
        num_stages=compiled.metadata.num_stages,
        **resources,
        shared_bytes=shared,
        ctas_per_sm=ctas_per_sm(resources["registers"], warps, shared),
        cp_async="cp.async" in compiled.asm["ptx"],
        constexprs=" ".join(f"{arg_names[p[0]]}={v}" for p, v in constexprs if len(p) == 1),
        seconds=round(seconds, 2),
    )


def _compile(source: Any, target: Any, options: Any) -> tuple[Any, str]:
    """The compiled kernel and ptxas's own report on it (`ptxas -v`, which Triton runs and
    prints when asked). Never from Triton's cache: a cached kernel runs no ptxas."""
    import triton
    from triton import knobs

    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=target, options=options.__dict__)
    return compiled, log.getvalue()


def _resources(log: str) -> dict[str, int]:
    """Registers, stack frame and spill stores a thread needs, from ptxas's report. Spills
    live in the stack frame, which can hold more than spills, so they are read as such."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    used = re.search(r"Used (\d+) registers", log)
    if frame is None or used is None:
        raise RuntimeError(f"ptxas printed no resource lines:\n{log}")
    regs, (stack, spills) = int(used[1]), map(int, frame.groups())
    return {"registers": regs, "stack_bytes": stack, "spill_bytes": spills}


def ctas_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """CTAs of a kernel one Hopper SM holds at once (CUDA's occupancy rules for sm_90: 64K
    registers given out per warp in units of 256, 228 KB of shared memory less 1 KB reserved
    per CTA, 64 warps, 32 CTAs)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // per_warp // warps
    by_shared = 228 * 1024 // (shared_bytes + 1024)
    return min(by_registers, by_shared, 64 // warps, 32)


def compile_cases(
    cases: list[Case], arch: int = HOPPER, progress: Callable[[int, Case], None] | None = None
) -> list[Usage | Failure]:
    """Every launch of every case, in order; launches the JIT would specialize alike (cases
    differing only in values it does not specialize on) share one compile. `progress` is
    called with each case's index before it compiles."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    done: dict[str, Usage | Failure] = {}
    results: list[Usage | Failure] = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, case)
        for launch in capture(case):
            spec = _specialize(launch, target)
            if spec.key not in done:
                done[spec.key] = _compile_specialized(case.label, launch, spec, target)
            results.append(replace(done[spec.key], case=case.label))
            if isinstance(results[-1], Usage):
                results[-1] = replace(results[-1], grid=launch.grid)
    return results


# -- engine shapes -------------------------------------------------------------------------


def _attention(case: Case) -> None:
    """One layer's paged attention as `LlamaModel._attention` calls it on the GPU: q [T, nh, d]
    as `rope_write` returns it, the pool's layer 1 (a storage offset), int32 tables and
    seq_index, int64 positions."""
    m, kind, ps = case.model, case.kind, case.page_size
    total = kind.rows * kind.tokens
    kv = PagedKVCache(2, m.num_kv_heads, m.head_dim, ps, -(-kind.context // ps), case.dtype)
    q = torch.zeros(total, m.num_heads, m.head_dim, dtype=case.dtype)
    start = kind.context - kind.tokens
    counts = torch.full((kind.rows,), kind.tokens, dtype=torch.int32)
    batch = ForwardBatch(
        slots=torch.zeros(total, dtype=torch.long),
        positions=(start + torch.arange(kind.tokens)).repeat(kind.rows),  # [total] int64
        seq_index=torch.arange(kind.rows, dtype=torch.int32).repeat_interleave(kind.tokens),
        query_starts=torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)]),
        block_tables=torch.zeros(kind.rows, case.width, dtype=torch.int32),
        max_query_len=kind.tokens if kind.max_query_len is None else kind.max_query_len,
    )
    PagedAttention("triton")(q, kv, 1, batch)


def _norms(case: Case) -> None:
    """The layer's norms on the residual stream x [T, H]: the first input norm, then the
    residual adds fused with the norm that reads the sum."""
    from smcspec.models import fused

    x = torch.zeros(case.kind.rows * case.kind.tokens, case.model.hidden, dtype=case.dtype)
    weight = torch.ones(case.model.hidden, dtype=case.dtype)
    fused.triton_rms_norm(x, weight, 1e-6)
    fused.triton_add_rms_norm(x, torch.zeros_like(x), weight, 1e-6)


def _rope_write(case: Case) -> None:
    """RoPE of qkv [T, nh + 2 nkv, d] (the qkv projection's output, viewed by head) by the
    rope table's rows cos, sin [T, d], writing k and v into layer 1 of the pool."""
    from smcspec.models import fused

    m, total = case.model, case.kind.rows * case.kind.tokens
    kv = PagedKVCache(2, m.num_kv_heads, m.head_dim, case.page_size, total, case.dtype)
    qkv = torch.zeros(total, m.num_heads + 2 * m.num_kv_heads, m.head_dim, dtype=case.dtype)
    cos = torch.ones(total, m.head_dim, dtype=case.dtype)
    slots = torch.arange(total, dtype=torch.long)
    fused.triton_rope_write(
        qkv, cos, torch.zeros_like(cos), kv.k[1], kv.v[1], slots, m.num_heads, m.num_kv_heads
    )


def _silu_mul(case: Case) -> None:
    """SwiGLU's gate of the gate_up projection's output [T, 2 I]."""
    from smcspec.models import fused

    rows = case.kind.rows * case.kind.tokens
    fused.triton_silu_mul(torch.zeros(rows, 2 * case.model.intermediate, dtype=case.dtype))


WRAPPERS: dict[str, Callable[[Case], None]] = {
    "attention": _attention,
    "norms": _norms,
    "rope_write": _rope_write,
    "silu_mul": _silu_mul,
}
PAGED = {"attention"}  # wrappers whose launches depend on the page size and the table width
ATTENTION_ONLY = {GRAPH_96_VERIFY}  # kinds that differ from another in attention's plan alone


def all_cases() -> list[Case]:
    """Every engine shape: the three models in bf16 and fp32, each launch kind; for paged
    wrappers the engine's page size (16, with a graph's and an eager table) and the tests'
    (4, 3, 1)."""
    tables = ((16, GRAPH_WIDTH), (16, EAGER_WIDTH), (4, EAGER_WIDTH), (3, EAGER_WIDTH))
    tables += ((1, EAGER_WIDTH),)
    cases = []
    for wrapper, model, dtype, kind in itertools.product(
        WRAPPERS, MODELS, (torch.bfloat16, torch.float32), KINDS
    ):
        if kind in ATTENTION_ONLY and wrapper != "attention":
            continue
        for ps, width in tables if wrapper in PAGED else tables[:1]:
            cases.append(Case(wrapper, model, dtype, kind, ps, width))
    return cases


def ci_cases() -> list[Case]:
    """A subset that still meets every kernel body the engine's shapes select: each head_dim
    (64, 128) and group (7, 6), both dtypes, every launch kind (decode tiles of 16 rows,
    verify and prefill tiles of 64, one sequence or several, counts divisible by 16 or not),
    a graph's and an eager table, page sizes 16 and 3."""
    bf16, fp32 = torch.bfloat16, torch.float32
    graphs = (GRAPH_96, GRAPH_96_VERIFY)
    picks = [(QWEN_05B, bf16, kind, 16, GRAPH_WIDTH) for kind in KINDS if kind not in graphs]
    picks += [
        (QWEN_7B, bf16, DECODE_1, 16, GRAPH_WIDTH),
        (QWEN_7B, bf16, GRAPH_96, 16, GRAPH_WIDTH),
        (QWEN_7B, bf16, GRAPH_96_VERIFY, 16, GRAPH_WIDTH),
        (QWEN_7B, bf16, VERIFY, 16, GRAPH_WIDTH),
        (QWEN_7B, bf16, VERIFY, 16, EAGER_WIDTH),
        (QWEN_15B, fp32, DECODE, 16, GRAPH_WIDTH),
        (QWEN_05B, fp32, VERIFY, 3, EAGER_WIDTH),
    ]
    return [
        Case(wrapper, *pick)
        for wrapper in WRAPPERS
        for pick in picks
        if (wrapper in PAGED or pick[3:] == (16, GRAPH_WIDTH))
        and (pick[2] not in ATTENTION_ONLY or wrapper == "attention")
    ]
