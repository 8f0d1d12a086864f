import pytest
import torch
import torch.nn.functional as F

from smcspec.models import cpu_linear
from smcspec.models.layers import DenseLinear, Int8Linear, make_linear
from smcspec.models.loader import resolve_dtype


@pytest.fixture
def weight():
    g = torch.Generator().manual_seed(0)
    return torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g) * 0.01


def test_reference_is_the_weight_rounded_per_channel(weight):
    w, b = weight
    layer = Int8Linear(w, b)
    eye = torch.eye(64)
    w_q = (layer.reference(eye) - b).T  # [96, 64], the de-quantized weight
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    # rounding to the nearest of 255 levels per row: off by at most half a step
    assert ((w_q - w).abs() <= scale / 2 + 1e-7).all()
    assert torch.allclose(w_q.abs().amax(dim=1), w.abs().amax(dim=1))


def test_fast_path_matches_reference_within_activation_rounding(weight):
    w, b = weight
    layer = Int8Linear(w, b)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    fast, ref = layer(x), layer.reference(x)
    # 8-bit activations with one step = peak / 127.5 (asymmetric over [-peak, peak]): the
    # error of each output is at most half a step times the row's sum of |W|
    step = x.abs().amax(dim=1, keepdim=True) / 127.5
    bound = step / 2 * (layer.reference(torch.eye(64)) - b).abs().sum(0)[None, :]
    assert ((fast - ref).abs() <= bound + 1e-5).all()
    assert (fast - ref).abs().max() > 0  # it really is quantized


def test_activation_scale_is_per_row(weight):
    """One row 1000x louder (an attention sink) must not drown the others' resolution."""
    w, b = weight
    layer = Int8Linear(w, b)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    loud = x.clone()
    loud[0] *= 1000
    torch.testing.assert_close(layer(loud)[1:], layer(x)[1:], rtol=0, atol=1e-6)
    quiet_error = (layer(x)[1:] - F.linear(x[1:], w, b)).abs().max()
    assert quiet_error < 0.01


def test_make_linear_and_dtypes(weight):
    w, b = weight
    int8 = cpu_linear.PackedLinear if cpu_linear.runs_int8() else Int8Linear
    assert isinstance(make_linear(w, b, "int8"), int8)
    dense = make_linear(w, b, "bfloat16")
    assert isinstance(dense, DenseLinear) and dense.weight.dtype == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == "int8"
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int3", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_dtype("int8", "cuda")


def test_banded_row_keeps_every_entry_within_its_own_rounding(weight):
    """A sink-like row (two entries hundreds of times the rest): each entry is quantized within
    2/255 of itself, so the error is bounded by sum_j |W_ij| 2 |x_j| / 255; the plain path,
    one scale for the row, wipes out the small entries and lands far outside that bound."""
    w, b = weight
    layer = Int8Linear(w, b)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    x[0, 5], x[0, 40] = 400.0, -90.0
    w_q = (layer.reference(torch.eye(64)) - b).T  # [96, 64]
    bound = (w_q.abs() * (2 * x.abs() / 255)).sum(1)  # [96]
    ref = layer.reference(x)[0]
    assert ((layer.banded(x)[0] - ref).abs() <= bound + 1e-4).all()
    assert ((layer(x)[0] - ref).abs() > bound).any()
