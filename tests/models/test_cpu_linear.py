"""smcspec's int4/int8 CPU kernel (`cpu_linear.PackedLinear`): the packed layouts, the weights it
rounds to, the product against the same arithmetic written out in PyTorch, the activations'
rounding bound, and what happens where it cannot run."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from smcspec.models import cpu_linear
from smcspec.models.cpu_linear import PackedLinear
from smcspec.models.layers import AtenInt4Linear, Int8Linear, make_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="the int4/int8 kernel did not build here"
)
BITS = pytest.mark.parametrize("bits", [4, 8])


@pytest.fixture(autouse=True)
def int8_activations():
    """Every product here on a path that rounds activations to int8 per group (AVX-512, or
    AMX's int8 tiles, bit-identical to it), never AMX's bf16 tiles: test_cpu_linear_amx checks
    those against their own arithmetic."""
    kernel = cpu_linear.KERNEL.get()
    rows = cpu_linear.AMX_ROWS
    old = {bits: kernel.set_amx_rows(bits, tiles, 0) for bits, (tiles, _) in rows.items()}
    yield
    for bits, pair in old.items():
        kernel.set_amx_rows(bits, *pair)


def weights_by_hand(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The weights the kernel should multiply by, written out apart from it: each group of
    `group` inputs maps [min, max] onto 0..2^bits - 1 with a float16 step and offset."""
    n, k = w.shape
    top = 2**bits - 1
    g = w.reshape(n, k // group, group)
    lo = g.amin(-1, keepdim=True).half().float()
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / top).half().float()
    q = torch.round((g - lo) / step).clamp(0, top)
    return (q * step + lo).reshape(n, k)


def activations_by_hand(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel reads it: each group of `group` inputs of a row rounded onto int8, its
    peak at 127 (in float32, as the kernel computes the factor)."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    peak = g.abs().amax(-1, keepdim=True)
    factor = torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))
    return (torch.round(g * factor) * (peak / 127)).reshape(m, k)


def test_each_nibble_sits_where_the_kernel_reads_it():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 24), generator=g, dtype=torch.uint8)
    packed = cpu_linear.pack(q, 4)
    assert packed.shape == (2, 3, 64)
    for block, sub, lane, i in [(0, 0, 0, 0), (1, 2, 15, 3), (0, 1, 7, 2), (1, 0, 3, 1)]:
        row, col = 16 * block + lane, 8 * sub + i
        assert packed[block, sub, 4 * lane + i] == q[row, col] | (q[row, col + 4] << 4)
    assert torch.equal(cpu_linear.unpack(packed, 4), q)


def test_each_int8_weight_sits_where_the_kernel_reads_it():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (32, 24), generator=g, dtype=torch.uint8)
    packed = cpu_linear.pack(q, 8)
    assert packed.shape == (2, 6, 64)
    for block, sub, lane, i in [(0, 0, 0, 0), (1, 5, 15, 3), (0, 1, 7, 2), (1, 0, 3, 1)]:
        assert packed[block, sub, 4 * lane + i] == q[16 * block + lane, 4 * sub + i]
    assert torch.equal(cpu_linear.unpack(packed, 8), q)


@BITS
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 33, 70])
def test_the_kernel_computes_the_product_of_its_rounded_operands(bits, group, rows):
    """Rows around the kernel's blocks of 6 and tiles of 32; every group size offered."""
    g = torch.Generator().manual_seed(rows * 1000 + group + bits)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(rows, 256, generator=g)
    x[0, 3] = 40.0  # a loud entry, as the attention sink makes: it coarsens its own group only
    bias = torch.randn(48, generator=g)
    linear = PackedLinear(w, bias, bits, group)
    expected = F.linear(
        activations_by_hand(x, group).double(),
        weights_by_hand(w, bits, group).double(),
        bias.double(),
    )
    got = linear(x)
    # integer sums are exact; what is left is float32 rounding in the sums over groups
    scale = (x.abs().double() @ w.abs().double().T) + 1.0
    assert ((got.double() - expected).abs() <= 1e-5 * scale).all()
    assert torch.equal(PackedLinear.from_quantized(*linear.quantized(), bias, bits)(x), got)


def test_int8_weights_at_the_ends_of_their_range_do_not_saturate():
    """Every weight at 0 or 255 against activations at +-127: the largest products the kernel's
    integer sums meet (the AVX2 path's byte products would saturate taken whole)."""
    w = torch.zeros(16, 64)
    w[:, ::2] = 1.0  # each group's min 0 and max 1: Q is 0 or 255
    x = torch.full((3, 64), 127.0)
    x[1] = -127.0
    linear = PackedLinear(w, None, 8, 32)
    expected = F.linear(x.double(), weights_by_hand(w, 8, 32).double())
    assert torch.allclose(linear(x).double(), expected, rtol=1e-6)


@BITS
def test_rounding_the_activations_costs_at_most_half_a_step_of_each_group(bits):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 512, generator=g) * 0.05
    x = torch.randn(9, 512, generator=g) * torch.rand(9, 512, generator=g) ** 4 * 10
    linear = PackedLinear(w, None, bits, 32)
    exact = linear.reference(x).double()  # the int4 weights, x unrounded
    got = linear(x).double()
    wq = linear.reference(torch.eye(512)).T.double()  # [64, 512]
    half_step = x.abs().reshape(9, 16, 32).amax(-1).double() / 254  # [9, groups]
    bound = half_step @ wq.abs().reshape(64, 16, 32).sum(-1).T  # [9, 64]
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert ((got - exact).abs() > bound * 0.01).any(), "activations kept in float would pass"


@BITS
def test_every_weight_is_within_half_a_step_of_itself(bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    read = cpu_linear.dequantize(*cpu_linear.quantize(w, bits, 32), bits)
    groups = w.reshape(64, 8, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)).repeat_interleave(32, dim=1)
    slack = step * 2**-10 + w.abs() * 2**-10  # the float16 step and offset
    assert ((read - w).abs() <= step / 2 + slack).all()
    assert ((read - w).abs() > step / 4).any(), f"a coarser grid than int{bits} would pass unseen"


@BITS
def test_any_leading_shape(bits):
    linear = PackedLinear(torch.randn(32, 128), torch.ones(32), bits, 64)
    x = torch.randn(2, 3, 128)
    assert torch.allclose(linear(x)[1, 2], linear(x[1, 2][None])[0])
    assert linear(x).shape == (2, 3, 32) and linear(x).dtype == torch.float32


@BITS
@pytest.mark.parametrize("group, inputs", [(16, 128), (48, 96), (100, 200), (256, 384), (0, 128)])
def test_a_bad_group_size_is_refused_naming_it(bits, group, inputs):
    with pytest.raises(ValueError, match=rf"int{bits} group size .* got {group}$"):
        cpu_linear.quantize(torch.randn(16, inputs), bits, group)


@pytest.mark.parametrize("dtype, bits", [("int4", 4), ("int8", 8)])
def test_a_matrix_the_blocks_do_not_tile_falls_back_to_fbgemm_int8(dtype, bits):
    if dtype == "int8" and not cpu_linear.runs_int8():
        pytest.skip("int8 runs on fbgemm on this CPU (no AVX-512 VNNI)")
    with pytest.raises(ValueError, match="blocks of 16, got 40"):
        cpu_linear.quantize(torch.randn(40, 128), bits, 32)
    assert isinstance(make_linear(torch.randn(40, 128), None, dtype), Int8Linear)
    assert isinstance(make_linear(torch.randn(48, 100), None, dtype), Int8Linear)  # K / group
    made = make_linear(torch.randn(48, 128), None, dtype)
    assert isinstance(made, PackedLinear) and made.bits == bits


def test_where_the_kernel_cannot_be_built_it_says_so_once_and_falls_back(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'x': c++: not found\nmore lines")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path))
    kernel = cpu_linear._Kernel()
    with pytest.warns(RuntimeWarning, match=r"could not be built \(Error building .*not found\)"):
        assert kernel.get() is None
    assert kernel.get() is None  # tried once
    monkeypatch.setattr(cpu_linear, "KERNEL", kernel)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int4"), AtenInt4Linear)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int8"), Int8Linear)


def test_every_install_builds_from_one_source_path(monkeypatch, tmp_path):
    """torch's build compiles again when a source's path changes: two installs of one source
    each naming its own file rebuilt the shared kernel at every start after the other's. Both
    name the copy in the build folder, written once."""
    from torch.utils import cpp_extension

    named = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: named.extend(kw["sources"]))
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path))
    cpu_linear._build()
    copies = [Path(source) for source in named]
    assert [c.name for c in copies] == [s.name for s in cpu_linear._SOURCES]
    for copy, source in zip(copies, cpu_linear._SOURCES, strict=True):
        assert copy.parent.parent == tmp_path / "kernels"
        assert copy.read_bytes() == source.read_bytes()
    written = [c.stat().st_mtime_ns for c in copies]
    others = []  # another install, same bytes
    for source in cpu_linear._SOURCES:
        other = tmp_path / "other-checkout" / source.name
        other.parent.mkdir(exist_ok=True)
        other.write_bytes(source.read_bytes())
        others.append(other)
    monkeypatch.setattr(cpu_linear, "_SOURCES", tuple(others))
    cpu_linear._build()
    assert named == [*map(str, copies)] * 2
    assert [c.stat().st_mtime_ns for c in copies] == written


@pytest.mark.parametrize("isa, int8", [("avx512-vnni", PackedLinear), ("avx2", Int8Linear)])
def test_int8_runs_on_the_kernel_only_where_it_has_vnni(monkeypatch, isa, int8):
    class Built:
        linear = staticmethod(lambda *args: None)

        @staticmethod
        def isa():
            return isa

    monkeypatch.setattr(cpu_linear.KERNEL, "get", lambda: Built)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int8"), int8)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int4"), PackedLinear)


@BITS
def test_a_banded_row_keeps_every_entry_within_its_own_rounding(bits):
    """A sink-like row (two entries hundreds of times the rest): split by magnitude, each entry
    is rounded within 2/254 of itself (half a step of a band whose peak is at most twice it), so
    the error is bounded by sum_j |W_ij| 2 |x_j| / 254; the plain call, one step per group, rounds
    the loud entries' neighbours away and lands outside that bound."""
    g = torch.Generator().manual_seed(3)
    linear = PackedLinear(torch.randn(96, 64, generator=g) * 0.05, torch.ones(96), bits, 32)
    x = torch.randn(1, 64, generator=g)
    x[0, 5], x[0, 40] = 400.0, -90.0
    w_q = (linear.reference(torch.eye(64)) - 1.0).T  # [96, 64]
    bound = (w_q.abs() * (2 * x.abs() / 254)).sum(1)  # [96]
    ref = linear.reference(x)[0]
    assert ((linear.banded(x)[0] - ref).abs() <= bound + 1e-4).all()
    assert ((linear(x)[0] - ref).abs() > bound).any()
    assert torch.equal(linear.banded(torch.zeros(1, 64)), torch.ones(1, 96))


def test_smcspec_cpu_kernel_off_runs_the_fallbacks_without_building(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built"))
    monkeypatch.setenv("SMCSPEC_CPU_KERNEL", "off")
    kernel = cpu_linear._Kernel()
    assert kernel.get() is None
    monkeypatch.setattr(cpu_linear, "KERNEL", kernel)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int4"), AtenInt4Linear)
    assert isinstance(make_linear(torch.randn(48, 128), None, "int8"), Int8Linear)
