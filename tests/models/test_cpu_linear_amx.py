"""The kernel's AMX paths (`csrc/cpu_linear.cpp`, "AMX"): int8 tiles give the vector path's
outputs to the bit at any number of rows; bf16 tiles give the product of the bf16-rounded rows
and de-quantized weights, summed in float32; threads each load their own tile configuration;
`SMCSPEC_AMX=off` and a refused permission leave every product on the vector path.

The product tests run where the CPU has AMX and Linux grants it, and are skipped elsewhere."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from smcspec.models import cpu_linear
from smcspec.models.cpu_linear import PackedLinear

KERNEL = cpu_linear.KERNEL.get()
USABLE = KERNEL is not None and KERNEL.amx() == ""
needs_amx = pytest.mark.skipif(
    not USABLE,
    reason="no AMX here: "
    + ("the kernel did not build" if KERNEL is None else KERNEL.amx() or "unknown"),
)
BITS = pytest.mark.parametrize("bits", [4, 8])
ROWS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 128]


@pytest.fixture
def engine():
    """engine(bits, tiles_from, bf16_from) routes products of `bits`-bit weights (0: never);
    the measured defaults come back after the test."""
    old = {bits: KERNEL.set_amx_rows(bits, *rows) for bits, rows in cpu_linear.AMX_ROWS.items()}
    yield lambda bits, tiles, bf16: KERNEL.set_amx_rows(bits, tiles, bf16)
    for bits, rows in old.items():
        KERNEL.set_amx_rows(bits, *rows)


def operands(rows: int, outputs: int, inputs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(outputs, inputs, generator=g) * 0.05
    x = torch.randn(rows, inputs, generator=g)
    x[0, 3] = 40.0  # a loud entry, as the attention sink makes
    return w, x


@needs_amx
@BITS
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "outputs, inputs, group",
    [(48, 256, 32), (80, 96, 32), (16, 512, 64), (32, 384, 128), (48, 512, 256)],
)
def test_int8_tiles_give_the_vector_paths_outputs_to_the_bit(
    engine, bits, rows, outputs, inputs, group
):
    """Odd block counts (3, 5: the last block alone), every group size, rows past and short of
    whole tiles of 16: the same integer sums, scaled in the same order."""
    w, x = operands(rows, outputs, inputs, seed=rows * 7 + outputs + group + bits)
    linear = PackedLinear(w, torch.randn(outputs), bits, group)
    engine(bits, 0, 0)
    vector = linear(x)
    engine(bits, 1, 0)
    tiles = linear(x)
    assert torch.equal(tiles, vector)


def bf16_by_hand(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The bf16 path's product written out apart from it: each stored weight de-quantized
    (scale Q + lo from the stored Q and float16 scales, rounded once to float32 as a fused
    multiply-add does) and rounded to bf16, each entry of x rounded to bf16, the products summed
    exactly (float64)."""
    packed, scales = linear.quantized()
    q = cpu_linear.unpack(packed, linear.bits).double()  # [N, K]
    blocks, groups = scales.shape[:2]
    sl = scales.double().permute(2, 0, 3, 1).reshape(2, blocks * cpu_linear.LANES, groups)
    step, lo = (s.repeat_interleave(linear.group, 1) for s in sl)
    weights = (q * step + lo).float().bfloat16().double()
    return F.linear(x.bfloat16().double(), weights, linear.bias.double())


@needs_amx
@BITS
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("outputs, inputs, group", [(48, 256, 32), (80, 96, 32), (32, 384, 128)])
def test_bf16_tiles_multiply_the_rounded_rows_by_the_dequantized_weights(
    engine, bits, rows, outputs, inputs, group
):
    w, x = operands(rows, outputs, inputs, seed=rows * 11 + outputs + group + bits)
    linear = PackedLinear(w, torch.randn(outputs), bits, group)
    engine(bits, 0, 1)
    got = linear(x).double()
    expected = bf16_by_hand(linear, x)
    # every bf16 product is exact in float32; float32 sums of `inputs` terms err at most
    # inputs * 2^-24 of the sum of their magnitudes
    bound = inputs * 2.0**-24 * (x.abs().double() @ w.abs().double().T + linear.bias.abs().double())
    assert ((got - expected).abs() <= bound + 1e-12).all()


@needs_amx
@BITS
def test_threads_each_configure_their_own_tiles(engine, bits):
    """Several threads (a server's) multiplying at once, each on its own shape of tiles: every
    result equals the one the thread's product gives alone."""
    engine(bits, 1, 64)  # int8 tiles below 64 rows, bf16 from 64: two tile configurations
    cases = [operands(rows, 48, 256, seed=rows) for rows in (3, 20, 64, 90)]
    linears = [PackedLinear(w, None, bits, 32) for w, _ in cases]
    alone = [linear(x) for linear, (_, x) in zip(linears, cases, strict=True)]
    failures: list[str] = []

    def run(i: int) -> None:
        for _ in range(20):
            if not torch.equal(linears[i](cases[i][1]), alone[i]):
                failures.append(f"case {i}")
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures and not any(t.is_alive() for t in threads)


class FakeKernel:
    """A built kernel whose AMX answer is `why`, recording the rows it is given."""

    def __init__(self, why: str) -> None:
        self.why, self.rows = why, {}

    def amx(self) -> str:
        return self.why

    def isa(self) -> str:
        return "avx512-vnni"

    def set_amx_rows(self, bits: int, tiles: int, bf16: int) -> list[int]:
        self.rows[bits] = (tiles, bf16)
        return [0, 0]


def test_amx_off_keeps_every_product_on_the_vector_path(monkeypatch):
    monkeypatch.setenv("SMCSPEC_AMX", "off")
    kernel = FakeKernel("")
    cpu_linear._set_amx(kernel)
    assert kernel.rows == {4: (0, 0), 8: (0, 0)}
    monkeypatch.setattr(cpu_linear.KERNEL, "get", lambda: kernel)
    assert cpu_linear.matrix_engine() == "avx512-vnni"
    monkeypatch.delenv("SMCSPEC_AMX")
    cpu_linear._set_amx(kernel)
    assert kernel.rows == cpu_linear.AMX_ROWS
    assert cpu_linear.matrix_engine() == "amx"


def test_a_refused_permission_is_said_once_where_the_cpu_lists_amx(monkeypatch, capsys):
    refused = "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: Operation not permitted"
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx512f", "amx_int8"})
    cpu_linear._set_amx(FakeKernel(refused))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and refused in err and "AVX-512 path runs" in err
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx512f"})  # an EPYC: nothing to say
    cpu_linear._set_amx(FakeKernel("the kernel was built without AMX"))
    assert capsys.readouterr().err == ""
    kernel = SimpleNamespace(amx=lambda: refused, isa=lambda: "avx512-vnni")
    monkeypatch.setattr(cpu_linear.KERNEL, "get", lambda: kernel)
    assert cpu_linear.matrix_engine() == "avx512-vnni"
