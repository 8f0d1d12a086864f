"""The layer's small steps, each one op on the dispatcher: RMSNorm, residual add + RMSNorm, RoPE
with the KV write, SiLU x up.

Written as plain torch, a bf16 layer's norms, rotation and gating are about 30 elementwise
kernels around its 4 matmuls, each a launch of a few microseconds on a GPU: more than the
weights' read of a small model's step. As torch custom ops (`smcspec::*`), each step is one
launch of a Triton kernel on CUDA (`_fused_kernels`), and one opaque node to CUDA graphs and
`torch.compile`. Elsewhere each runs its reference, the plain torch code below, with the
rounding of Hugging Face's layers; the CPU engine does not call these ops at all (`LlamaModel`
keeps the plain path there), but the reference is what the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] as Hugging Face's: in bf16 the variance is taken in float32 and the
    normalised x rounded to bf16 before the weight multiplies it (two roundings)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [total, heads, d] with cos, sin [total, d] (halves convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@torch.library.custom_op("smcspec::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] times weight [H]: [T, H]."""
    return rms_reference(x, weight, eps)


@torch.library.custom_op("smcspec::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's update and the norm read from it: new = x + residual [T, H];
    returns (rms_norm(new) * weight, new)."""
    new = x + residual
    return rms_reference(new, weight, eps), new


@torch.library.custom_op("smcspec::rope_write", mutates_args=("k_cache", "v_cache"))
def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
) -> torch.Tensor:
    """Rotate the q and k heads of qkv [T, nh + 2 nkv, d] by cos, sin [T, d]; store the rotated
    k and the v heads at flat slots [T] of one layer's pool k_cache, v_cache [pages, page_size,
    nkv, d]; return the rotated q [T, nh, d]."""
    d = qkv.shape[-1]
    qk = rotate_reference(qkv[:, : nh + nkv], cos, sin)  # q and k heads rotated together
    k_cache.view(-1, nkv, d)[slots] = qk[:, nh:]
    v_cache.view(-1, nkv, d)[slots] = qkv[:, nh + nkv :]
    return qk[:, :nh]


@torch.library.custom_op("smcspec::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: silu(gate) * up of gate_up [T, 2 I] = [gate | up]: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Shapes alone, for the meta device (the launch count) and for tracing.
@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@add_rms_norm.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@rope_write.register_fake
def _(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], nh, qkv.shape[-1])


@silu_mul.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[-1] // 2)


# The Triton launchers. Imported when first called: Triton is an optional dependency, and the
# CPU engine never gets here. Plain functions, so the CPU tests can run them through Triton's
# interpreter in place of the ops (`TRITON`).
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from smcspec.models import _fused_kernels

    return _fused_kernels.rms_norm(x.contiguous(), weight, eps)


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from smcspec.models import _fused_kernels

    return _fused_kernels.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def triton_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
) -> torch.Tensor:
    from smcspec.models import _fused_kernels

    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    return _fused_kernels.rope_write(qkv, cos, sin, k_cache, v_cache, slots, nh, nkv)


def triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from smcspec.models import _fused_kernels

    return _fused_kernels.silu_mul(gate_up.contiguous())


rms_norm.register_kernel("cuda")(triton_rms_norm)
add_rms_norm.register_kernel("cuda")(triton_add_rms_norm)
rope_write.register_kernel("cuda")(triton_rope_write)
silu_mul.register_kernel("cuda")(triton_silu_mul)

# Each op's name here and the function its CUDA kernel runs.
TRITON = {
    "rms_norm": triton_rms_norm,
    "add_rms_norm": triton_add_rms_norm,
    "rope_write": triton_rope_write,
    "silu_mul": triton_silu_mul,
}
