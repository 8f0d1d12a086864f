"""smcspec's int4 CPU kernel (`int4.Int4Linear`): the packed layout, the weights it rounds to, the
product against the same arithmetic written out in PyTorch, the activations' rounding bound, and
what happens where it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from smcspec.models import int4
from smcspec.models.layers import AtenInt4Linear, Int8Linear, make_linear

pytestmark = pytest.mark.skipif(not int4.available(), reason="the int4 kernel did not build here")


def weights_by_hand(w: torch.Tensor, group: int) -> torch.Tensor:
    """The weights the kernel should multiply by, written out apart from it: each group of
    `group` inputs maps [min, max] onto 0..15 with a float16 step and offset."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo = g.amin(-1, keepdim=True).half().float()
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).half().float()
    q = torch.round((g - lo) / step).clamp(0, 15)
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
    packed = int4.pack(q)
    assert packed.shape == (2, 3, 64)
    for block, sub, lane, i in [(0, 0, 0, 0), (1, 2, 15, 3), (0, 1, 7, 2), (1, 0, 3, 1)]:
        row, col = 16 * block + lane, 8 * sub + i
        assert packed[block, sub, 4 * lane + i] == q[row, col] | (q[row, col + 4] << 4)
    assert torch.equal(int4.unpack(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 33, 70])
def test_the_kernel_computes_the_product_of_its_rounded_operands(group, rows):
    """Rows around the kernel's blocks of 6 and tiles of 32; every group size offered."""
    g = torch.Generator().manual_seed(rows * 1000 + group)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(rows, 256, generator=g)
    x[0, 3] = 40.0  # a loud entry, as the attention sink makes: it coarsens its own group only
    bias = torch.randn(48, generator=g)
    linear = int4.Int4Linear(w, bias, group)
    expected = F.linear(
        activations_by_hand(x, group).double(), weights_by_hand(w, group).double(), bias.double()
    )
    got = linear(x)
    # integer sums are exact; what is left is float32 rounding in the sums over groups
    scale = (x.abs().double() @ w.abs().double().T) + 1.0
    assert ((got.double() - expected).abs() <= 1e-5 * scale).all()
    assert torch.equal(int4.Int4Linear.from_quantized(*linear.quantized(), bias)(x), got)


def test_rounding_the_activations_costs_at_most_half_a_step_of_each_group():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 512, generator=g) * 0.05
    x = torch.randn(9, 512, generator=g) * torch.rand(9, 512, generator=g) ** 4 * 10
    linear = int4.Int4Linear(w, None, 32)
    exact = linear.reference(x).double()  # the int4 weights, x unrounded
    got = linear(x).double()
    wq = linear.reference(torch.eye(512)).T.double()  # [64, 512]
    half_step = x.abs().reshape(9, 16, 32).amax(-1).double() / 254  # [9, groups]
    bound = half_step @ wq.abs().reshape(64, 16, 32).sum(-1).T  # [9, 64]
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert ((got - exact).abs() > bound * 0.01).any(), "activations kept in float would pass"


def test_every_weight_is_within_half_a_step_of_itself():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    read = int4.dequantize(*int4.quantize(w, 32))
    groups = w.reshape(64, 8, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    slack = step * 2**-10 + w.abs() * 2**-10  # the float16 step and offset
    assert ((read - w).abs() <= step / 2 + slack).all()
    assert ((read - w).abs() > step / 4).any(), "a coarser grid than int4 would pass unseen"


def test_any_leading_shape():
    linear = int4.Int4Linear(torch.randn(32, 128), torch.ones(32), 64)
    x = torch.randn(2, 3, 128)
    assert torch.allclose(linear(x)[1, 2], linear(x[1, 2][None])[0])
    assert linear(x).shape == (2, 3, 32) and linear(x).dtype == torch.float32


@pytest.mark.parametrize("group, inputs", [(16, 128), (48, 96), (100, 200), (256, 384), (0, 128)])
def test_a_bad_group_size_is_refused_naming_it(group, inputs):
    with pytest.raises(ValueError, match=rf"int4 group size .* got {group}$"):
        int4.quantize(torch.randn(16, inputs), group)


def test_a_matrix_the_blocks_do_not_tile_falls_back_to_int8():
    with pytest.raises(ValueError, match="blocks of 16, got 40"):
        int4.quantize(torch.randn(40, 64), 32)
    assert isinstance(make_linear(torch.randn(40, 64), None, "int4"), Int8Linear)
    assert isinstance(make_linear(torch.randn(48, 64), None, "int4"), int4.Int4Linear)


def test_where_the_kernel_cannot_be_built_int4_says_so_once_and_runs_on_pytorch(
    monkeypatch, tmp_path
):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'x': c++: not found\nmore lines")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path))
    kernel = int4._Kernel()
    with pytest.warns(RuntimeWarning, match=r"could not be built \(Error building .*not found\)"):
        assert kernel.get() is None
    assert kernel.get() is None  # tried once
    monkeypatch.setattr(int4, "KERNEL", kernel)
    assert isinstance(make_linear(torch.randn(48, 64), None, "int4"), AtenInt4Linear)
