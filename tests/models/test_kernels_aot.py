"""Every engine Triton kernel compiled ahead of time for sm_90 (H100 / H200), with no GPU.

The other kernel tests run Triton's interpreter, which accepts kernels the GPU compiler refuses
(a loop-carried value that changes type, a dot too small for the tensor cores) and says nothing
of registers or spills. Here `smcspec.models.aot` calls each kernel's wrapper at engine shapes,
records the launches, and compiles them for sm_90 with the ptxas Triton bundles.

The compile runs in a subprocess without TRITON_INTERPRET: tests/conftest.py sets it for the
whole process, and triton.jit picks the interpreter when it decorates. That subprocess is this
file run as a script; it also compiles two probe kernels, each broken in one way the checks
below must catch, so a harness that stopped seeing failures would fail here.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
tl = triton.language

ROOT = Path(__file__).resolve().parents[2]
# Two CTAs resident per SM at the least, so one's loads overlap the other's math: at most
# 32K registers a CTA (128 a thread at 8 warps; the 255 ptxas allows at 4) and about 113 KB of
# shared memory. A kernel past that runs one CTA an SM, with nothing to hide its waits.
MIN_CTAS_PER_SM = 2


@triton.jit
def _interpreter_only(x_ptr, N: tl.constexpr):
    """The interpreter lets `acc` turn from a float into a [N] tensor inside the loop; the
    compiler wants a loop-carried value's type fixed."""
    acc = 0.0
    for i in range(0, 4):
        acc = acc + tl.load(x_ptr + i * N + tl.arange(0, N))
    tl.store(x_ptr + tl.arange(0, N), acc)


@triton.jit
def _spilling(x_ptr, N: tl.constexpr):
    """A [N, N] float32 tile kept live across a reduction by one warp: N * N / 32 values a
    thread, past the 255 registers ptxas can give it at N = 128."""
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(x_ptr + offs, x - tl.sum(x, axis=1)[:, None])


def _probes() -> list:
    import torch

    from smcspec.models import aot

    x = torch.zeros(128 * 128)
    with aot.intercept() as launches:
        _interpreter_only[(1,)](x, N=64)
        _spilling[lambda meta: (meta["N"] // 64,)](x, N=128, num_warps=1)  # a grid from meta
    return [aot.compile_launch("probe", launch) for launch in launches]


def _main() -> None:
    """The subprocess: the CI cases and the probes, one JSON list on the last line."""
    from smcspec.models import aot

    rows = [{"type": type(r).__name__, **asdict(r)} for r in aot.compile_cases(aot.ci_cases())]
    rows += [{"type": type(r).__name__, **asdict(r)} for r in _probes()]
    print(json.dumps(rows))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The subprocess's rows, computed once per run: under xdist the first worker to get here
    compiles and the others read its file (xdist_group does not keep these tests on one
    worker with this pytest: a suffixed _nodeid no longer changes Node.nodeid)."""
    from smcspec.models import aot

    missing = aot.missing_tools()
    if missing:
        pytest.skip(f"cannot compile for the GPU here: {missing}")
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _compile()
    shared = tmp_path_factory.getbasetemp().parent / "kernels_aot.json"  # this run's workers'
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.is_file():
            shared.write_text(json.dumps(_compile()))
        return json.loads(shared.read_text())


def _compile() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _engine(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["case"] != "probe"]


def test_every_engine_kernel_compiles_for_sm90(compiled: list[dict]) -> None:
    engine = _engine(compiled)
    failed = [f"{r['case']}: {r['kernel']}: {r['error']}" for r in engine if r["type"] == "Failure"]
    assert not failed, "\n".join(failed)
    kernels = {r["kernel"] for r in engine}
    assert {"paged_attention_kernel", "_rms_norm_kernel", "_rope_write_kernel"} <= kernels
    assert "_silu_mul_kernel" in kernels


def test_no_spills_and_two_ctas_per_sm(compiled: list[dict]) -> None:
    usages = [r for r in _engine(compiled) if r["type"] == "Usage"]  # failures: the test above
    for r in usages:
        what = f"{r['case']}: {r['kernel']} ({r['constexprs']})"
        # values the registers could not hold go to local memory
        assert r["spill_bytes"] == 0, f"{what} spills {r['spill_bytes']} bytes"
        assert r["registers"] <= 255, f"{what} uses {r['registers']} registers"
        assert r["ctas_per_sm"] >= MIN_CTAS_PER_SM, (
            f"{what}: {r['ctas_per_sm']} CTA per SM "
            f"({r['registers']} registers x {r['num_warps']} warps, {r['shared_bytes']} B shared)"
        )


def test_attention_loads_are_pipelined(compiled: list[dict]) -> None:
    """The key loop's K/V loads go through cp.async into shared memory, num_stages deep, so
    the next tiles' loads overlap this tile's dots (the review's finding 1: a loop without
    it waits on three dependent global round trips per tile)."""
    attention = [r for r in _engine(compiled) if r["kernel"] == "paged_attention_kernel"]
    assert attention
    for r in attention:
        assert r["type"] == "Usage" and r["cp_async"], f"{r['case']}: no cp.async in the PTX"


def test_the_checks_catch_a_broken_kernel(compiled: list[dict]) -> None:
    """The probes: a kernel only the interpreter accepts fails to compile, and one that needs
    more than 255 registers reports spills."""
    probes = {r["kernel"]: r for r in compiled if r["case"] == "probe"}
    assert probes["_interpreter_only"]["type"] == "Failure", probes["_interpreter_only"]
    assert probes["_spilling"]["type"] == "Usage", probes["_spilling"]
    assert probes["_spilling"]["grid"] == [2]
    assert probes["_spilling"]["spill_bytes"] > 0, probes["_spilling"]


if __name__ == "__main__":
    _main()
