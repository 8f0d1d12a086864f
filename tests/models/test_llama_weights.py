"""Building the native model's linears: a tall matrix (the output layer's) quantized a block of
rows at a time for smcspec's kernel is bit for bit the matrix quantized whole."""

import pytest
import torch

from smcspec.models import cpu_linear, llama_weights
from smcspec.models.layers import make_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="the int4/int8 kernel did not build here"
)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("rows", [16 * 11, 16 * 11 + 3])
def test_a_tall_matrix_quantized_by_rows_is_the_whole_one(dtype, rows, monkeypatch):
    if dtype == "int8" and not cpu_linear.runs_int8():
        pytest.skip("int8 runs on fbgemm here, not on the kernel")
    monkeypatch.setattr(llama_weights, "ROWS_AT_ONCE", 48)  # blocks of 48, 48, 48, 32 rows
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, 256, generator=g)
    weight[5, :7] *= 300.0  # a loud row, and loud groups in it
    bias = torch.randn(rows, generator=g)
    by_rows = llama_weights.made_by_rows(weight, bias, dtype, torch.device("cpu"))
    whole = make_linear(weight, bias, dtype, "cpu")
    assert type(by_rows) is type(whole)
    assert (type(whole) is cpu_linear.PackedLinear) == (rows % cpu_linear.LANES == 0)
    for mine, want in zip(by_rows.quantized(), whole.quantized(), strict=True):
        assert mine.dtype == want.dtype and torch.equal(mine, want)
    assert torch.equal(by_rows.bias, whole.bias)
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(by_rows(x), whole(x))
