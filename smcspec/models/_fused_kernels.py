"""Triton kernels of a layer's small steps: RMSNorm, residual add + RMSNorm, RoPE with the KV
write, SiLU x up. Each is one launch where the plain torch code takes 3 to 9 (`fused` wraps
them as torch custom ops), and is tested against that torch code (Hugging Face's layers).

Each kernel computes in float32 and rounds to the activations' dtype exactly where the torch
code does, so that in bf16 it reproduces Hugging Face's rounding:

    rms_norm(x)   = round(round(x * rsqrt(mean(x^2) + eps)) * w)      (variance in float32)
    add_rms_norm  = rms_norm(round(x + residual)), and round(x + residual) itself
    rope(x)       = round(round(x * cos) + round(rotate_half(x) * sin))
    silu_mul(g|u) = round(round(g / (1 + exp(-g))) * u)

A product of two bf16 values is exact in float32, so one rounding to bf16 after it equals torch's
bf16 multiply; the RoPE and the add are therefore bit-exact in bf16. Where a float32 step has
no exact answer (the variance's summation order, rsqrt, exp) the kernel may land on the other
side of a bf16 rounding boundary now and then: one bf16 ulp, rarely.

No kernel reads a value back to the host, and each launch depends on shapes only, so all four
can be captured in a CUDA graph. A module of its own, imported on first use: Triton is optional,
and triton.jit picks compiler or interpreter (TRITON_INTERPRET) when it decorates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a row one program holds at a time: 8 per thread at 4 warps (16-byte bf16 loads).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to the nearest value of `dtype` (ties to even), kept in float32.
    For bf16 by integer arithmetic on the bits: Triton's interpreter truncates on a plain
    .to(tl.bfloat16) (the GPU rounds to nearest), so the CPU tests would judge another kernel."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # a carry into the exponent is right
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        x = tl.where(x == x, rounded, x)  # NaN stays NaN
    elif dtype != tl.float32:
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    H,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row of x [T, H], in chunks of BLOCK columns, two passes: the sum of
    squares, then the scaled row. With HAS_RESIDUAL the row is round(x + residual), stored in
    res_out; the second pass recomputes it from the inputs instead of reading res_out back."""
    ty = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, H, BLOCK):
        mask = start + cols < H
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + start + cols, mask=mask, other=0.0)
            x = _round(x + r.to(tl.float32), ty)
            tl.store(res_out_ptr + row * stride_res_out + start + cols, x.to(ty), mask=mask)
        squares += x * x
    inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        mask = start + cols < H
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + start + cols, mask=mask, other=0.0)
            x = _round(x + r.to(tl.float32), ty)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        # HF's two roundings: the normalised row, then its product with the weight
        out = _round(_round(x * inv_rms, ty) * w, ty)
        tl.store(out_ptr + row * stride_out + start + cols, out.to(ty), mask=mask)


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    NH,
    NKV,
    stride_qkv_t,
    stride_qkv_h,
    stride_cos,
    stride_sin,
    stride_q_t,
    stride_q_h,
    stride_slot,
    stride_head,
    HALF: tl.constexpr,
):
    """One program per (token t, head h) of qkv [T, NH + 2 NKV, 2 HALF]: a q head is rotated
    into q [T, NH, d], a k head rotated into the pool at slots[t], a v head copied there."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dims = tl.arange(0, HALF)
    src = qkv_ptr + t * stride_qkv_t + h * stride_qkv_h + dims
    x1 = tl.load(src)  # [HALF] first half
    x2 = tl.load(src + HALF)  # [HALF] second half
    slot = tl.load(slots_ptr + t)  # int64: slot * stride_slot may pass 2^31
    if h < NH + NKV:
        c1 = tl.load(cos_ptr + t * stride_cos + dims).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos + HALF + dims).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_sin + dims).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_sin + HALF + dims).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        ty = q_ptr.dtype.element_ty
        # rotate_half(x) = [-x2, x1]; each product rounded before the sum, as torch's
        out1 = _round(_round(a1 * c1, ty) - _round(a2 * s1, ty), ty).to(ty)
        out2 = _round(_round(a2 * c2, ty) + _round(a1 * s2, ty), ty).to(ty)
        if h < NH:
            dst = q_ptr + t * stride_q_t + h * stride_q_h + dims
        else:
            dst = k_cache_ptr + slot * stride_slot + (h - NH) * stride_head + dims
        tl.store(dst, out1)
        tl.store(dst + HALF, out2)
    else:
        dst = v_cache_ptr + slot * stride_slot + (h - NH - NKV) * stride_head + dims
        tl.store(dst, x1)
        tl.store(dst + HALF, x2)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    inter,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    """Program (t, j) gates columns j BLOCK .. (j + 1) BLOCK - 1 of row t of gate_up
    [T, 2 inter]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + t * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds its output to the input dtype before the multiply by up
    ty = out_ptr.dtype.element_ty
    silu = _round(gate / (1.0 + tl.exp(-gate)), ty)
    tl.store(out_ptr + t * stride_out + cols, _round(silu * up, ty).to(ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """RMSNorm of x [T, H] times weight [H], into out [T, H] (a new tensor if None; not x:
    the row is read twice). Grid (T,), `block` columns per chunk, NUM_WARPS warps."""
    _check_rows("x", x, weight)
    out = torch.empty_like(x) if out is None else out
    _check_like("out", out, x)
    _norm(x, None, weight, eps, out, None, block)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """new = x + residual [T, H] (rounded to their dtype) and RMSNorm(new) * weight, in one
    launch: returns (normed, new). Grid (T,), `block` columns per chunk, NUM_WARPS warps."""
    _check_rows("x", x, weight)
    _check_like("residual", residual, x)
    normed, new = torch.empty_like(x), torch.empty_like(x)
    _norm(x, residual, weight, eps, normed, new, block)
    return normed, new


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    block: int,
) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    # without a residual its pointers are never read: any tensor of the right dtype stands in
    res, new = (x, out) if residual is None else (residual, res_out)
    _rms_norm_kernel[(num_rows,)](
        x,
        res,
        weight,
        out,
        new,
        float(eps),
        hidden,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        new.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=min(block, triton.next_power_of_2(hidden)),
        num_warps=NUM_WARPS,
    )


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
    """Rotate the q and k heads of qkv [T, nh + 2 nkv, d] by cos, sin [T, d] (halves
    convention); store the rotated k and the v heads at flat slots [T] (int64) of one layer's
    pool views k_cache, v_cache [num_pages, page_size, nkv, d]; return the rotated q [T, nh, d].
    Grid (T, nh + 2 nkv), one warp per program."""
    _check_rope(qkv, cos, sin, k_cache, v_cache, slots, nh, nkv)
    num_tokens, heads, head_dim = qkv.shape
    q = qkv.new_empty(num_tokens, nh, head_dim)
    if num_tokens == 0:
        return q
    _rope_write_kernel[(num_tokens, heads)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slots,
        nh,
        nkv,
        qkv.stride(0),
        qkv.stride(1),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HALF=head_dim // 2,
        num_warps=1,
    )
    return q


def silu_mul(gate_up: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 I] = [gate | up]: [T, I].
    Grid (T, ceil(I / block)), NUM_WARPS warps."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 I], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up must be contiguous along its columns")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, inter)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(block, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        inter,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=NUM_WARPS,
    )
    return out


def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, H], contiguous along H, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.stride(0) != 1:
        raise ValueError(f"weight must be [{x.shape[1]}] and contiguous, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be {x.dtype} as {name}, got {weight.dtype}")


def _check_like(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.shape != x.shape or t.dtype != x.dtype or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be {tuple(x.shape)} {x.dtype}, contiguous along H, "
            f"got {tuple(t.shape)} {t.dtype}"
        )


def _check_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
) -> None:
    if qkv.dim() != 3 or qkv.shape[1] != nh + 2 * nkv or nh < 1 or nkv < 1:
        raise ValueError(f"qkv must be [T, nh + 2 nkv, d] = [T, {nh + 2 * nkv}, d], got "
                         f"{tuple(qkv.shape)}")  # fmt: skip
    num_tokens, _, head_dim = qkv.shape
    if head_dim < 2 or head_dim & (head_dim - 1):
        # a head is two tl.arange halves, whose length must be a power of two
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, head_dim) or t.dtype != qkv.dtype:
            raise ValueError(
                f"{name} must be [{num_tokens}, {head_dim}] {qkv.dtype}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    pool = (k_cache.shape[0], k_cache.shape[1], nkv, head_dim)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[2:] != (nkv, head_dim) or t.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [num_pages, page_size, {nkv}, {head_dim}] "
                             f"{qkv.dtype}, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
        # flat slot s is page s // page_size, offset s % page_size: one stride must span both
        if t.shape != pool or t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(f"{name} must be a contiguous run of pages like k_cache")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if slots.shape != (num_tokens,) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [{num_tokens}] int64, got {tuple(slots.shape)} "
                         f"{slots.dtype}")  # fmt: skip
    if {qkv.stride(-1), cos.stride(-1), sin.stride(-1), k_cache.stride(-1)} != {1}:
        raise ValueError("qkv, cos, sin and the caches must be contiguous along head_dim")
