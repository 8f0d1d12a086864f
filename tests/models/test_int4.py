"""int4 weights per group on PyTorch's CPU kernel (`AtenInt4Linear`, the fallback where smcspec's
own kernel cannot be built): the packing convention, the rounding bound and the checks on the
group size; and the int4 dtype end to end, on whichever kernel this machine runs."""

import pytest
import torch
import torch.nn.functional as F

from smcspec.models.layers import INT4_GROUPS, AtenInt4Linear


def dequantized_by_hand(w: torch.Tensor, group: int) -> torch.Tensor:
    """The weights `AtenInt4Linear` should multiply by, written out apart from it: each group of
    `group` inputs maps [min, max] onto 0..15 with a bf16 scale and offset."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
    zero = (lo + 8 * scale).bfloat16().float()
    q = torch.round((g - zero) / scale + 8).clamp(0, 15)
    return ((q - 8) * scale + zero).reshape(n, k)


@pytest.mark.parametrize("group", INT4_GROUPS)
def test_the_kernel_multiplies_by_the_weights_the_packing_describes(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(96, 512, generator=g) * 0.02
    bias = torch.randn(96, generator=g)
    x = torch.randn(7, 512, generator=g)
    linear = AtenInt4Linear(w, bias, group)
    expected = F.linear(x.bfloat16().float(), dequantized_by_hand(w, group), bias)
    got = linear(x)
    # bf16 products and output: about 2^-8 of each output's size
    assert ((got - expected).norm() / expected.norm()) < 4e-3
    same = AtenInt4Linear.from_quantized(*linear.quantized(), bias, group, 512)
    assert torch.equal(same(x), got)


def test_every_weight_is_within_half_a_step_of_itself():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    linear = AtenInt4Linear(w, None, 32)
    # the kernel applied to the identity reads back W^T (rounded to bf16 on the way out)
    read = linear(torch.eye(256)).T  # [64, 256]
    groups = w.reshape(64, 8, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)  # [64, 256]
    slack = step * 0.01 + w.abs() * 2**-8  # the bf16 scale and zero, the bf16 output
    assert ((read - w).abs() <= step / 2 + slack).all()
    assert ((read - w).abs() > step / 4).any(), "a coarser grid than int4 would pass unseen"


def test_any_leading_shape_and_a_bias():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    linear = AtenInt4Linear(w, torch.ones(32), 64)
    x = torch.randn(2, 3, 128)
    assert torch.allclose(linear(x)[1, 2], linear(x[1, 2][None])[0])
    assert linear(x).shape == (2, 3, 32) and linear(x).dtype == torch.float32


@pytest.mark.parametrize(
    "group, inputs", [(16, 128), (48, 96), (100, 200), (256, 384), (0, 128), (-32, 128)]
)
def test_a_bad_group_size_is_refused_naming_it(group, inputs):
    with pytest.raises(ValueError, match=rf"int4 group size .* got {group}$"):
        AtenInt4Linear(torch.randn(8, inputs), None, group)


def test_int4_is_refused_where_it_cannot_run_in_one_line():
    from smcspec.models.hf import load as load_hf
    from smcspec.models.loader import resolve_dtype

    assert resolve_dtype("int4", "cpu") == "int4"
    with pytest.raises(ValueError, match=r"^int4 weights run on the CPU only"):
        resolve_dtype("int4", "cuda")
    with pytest.raises(ValueError, match=r"^int4 weights run on the native engine only"):
        load_hf("/nonexistent/model", "int4", "cpu")


def test_a_pair_in_int4_generates_as_the_methods_promise(
    tiny_llama_folder, tiny_llama_draft_folder
):
    from smcspec import LLM

    llm = LLM(str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native", dtype="int4")
    greedy = dict(temperature=0.0, max_new_tokens=12, stop_at_eos=False)
    ar = llm.generate("w1 w2 w3", method="ar", **greedy)
    sd = llm.generate("w1 w2 w3", method="sd", draft_tokens=3, **greedy)
    assert len(ar.token_ids) == 12 and sd.token_ids == ar.token_ids  # sd is exact, also in int4
