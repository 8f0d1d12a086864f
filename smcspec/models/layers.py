"""Linear layers of the native model: a plain floating-point reference and the int8 and int4 fast
paths. Both run on smcspec's own kernel (`cpu_linear.PackedLinear`) where it builds (int8 where
it has AVX-512 VNNI, `cpu_linear.runs_int8`); elsewhere int8 runs on fbgemm (`Int8Linear`) and
int4 on PyTorch's kernel (`AtenInt4Linear`).

`Int8Linear` stores weights as symmetric int8 with one scale per output channel and runs through
fbgemm's dynamic quantized linear, which quantizes the activations on the fly with one scale per
call. On a CPU without wide float units this reads a quarter of the bytes of fp32 and multiplies
several rows for the price of one. `reference` runs the same int8 weights de-quantized in float
(weight-only int8), for the few positions whose activations are too large for a shared scale.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from smcspec.models import cpu_linear

_LINEAR_INT8 = torch.ops.quantized.linear_dynamic.default  # the overload itself: less dispatch
# torch calls its quantized tensors deprecated, once per process, from whichever thread packs
# first (the loader packs on a thread pool, where a `catch_warnings` block does not reach): the
# message names nothing a user can act on, so it is filtered here, by its text alone.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel",
    category=UserWarning,
)


class DenseLinear:
    """y = x W^T + b in the weights' own dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    reference = __call__
    banded = __call__


class Int8Linear:
    """W ~= diag(scale) Q with Q int8 in [-127, 127]; activations int8 per call (fbgemm)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, reduce_range: bool = False
    ) -> None:
        self._pack(*quantize(weight), bias, reduce_range)

    @classmethod
    def from_quantized(
        cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """From an int8 matrix q [out, in] and its scales [out] (see `quantize`)."""
        linear = cls.__new__(cls)
        linear._pack(q, scale, bias, False)
        return linear

    def _pack(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool
    ) -> None:
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1])
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.reduce_range = reduce_range

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [out, in], scale float32 [out]): what `from_quantized` takes back."""
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fbgemm picks one activation scale per call; rescaling every row to the same peak
        # first makes that scale per row (per token), so one loud row cannot drown the rest.
        # In place on the output: for a long prefill it is the largest tensor of the layer.
        if x.numel() == x.shape[-1]:  # one row: its own scale already
            y = _LINEAR_INT8(x, self.packed, self.reduce_range)
        else:
            peak = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-6)  # [..., 1]
            y = _LINEAR_INT8(x / peak, self.packed, self.reduce_range).mul_(peak)
        return y if self.bias is None else y.add_(self.bias)

    def banded(self, x: torch.Tensor) -> torch.Tensor:
        """One row x [1, in] with a huge dynamic range (the attention sink): split by magnitude
        (`cpu_linear.magnitude_bands`) into rows run through the int8 kernel at once, each at
        its own scale; the sum is W x with every entry quantized to within 2/255 of itself."""
        rows = cpu_linear.magnitude_bands(x)  # [bands, in]
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)  # [bands, 1]
        y = (_LINEAR_INT8(rows / scale, self.packed, self.reduce_range) * scale).sum(0, True)
        return y if self.bias is None else y + self.bias

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same int8 weights in float, activations unquantized."""
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return F.linear(x.float(), qweight.dequantize(), self.bias)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output channel: (q [out, in], scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class AtenInt4Linear:
    """Weight-only int4 per group (the fallback where smcspec's kernel, `cpu_linear.PackedLinear`,
    cannot be built): W[n, k] ~= (Q[n, k] - 8) * scale[g, n] + zero[g, n] for the
    group g = k // group of inputs, Q in [0, 15], two to a byte in the layout of PyTorch's CPU
    kernel (`aten._weight_int4pack_mm_for_cpu`), which multiplies bf16 activations by it. The
    activations are not quantized, so no row needs a band of its own (`banded` is the call).
    Packed once (`quantized`), the tensors are plain ones that the weight cache stores."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32
    ) -> None:
        packed, scales_zeros = quantize_int4(weight, group)
        self._set(packed, scales_zeros, bias, group, int(weight.shape[1]))

    @classmethod
    def from_quantized(
        cls,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group: int,
        in_features: int,
    ) -> AtenInt4Linear:
        """From `quantized()`'s tensors."""
        linear = cls.__new__(cls)
        linear._set(packed, scales_zeros, bias, group, in_features)
        return linear

    def _set(self, packed, scales_zeros, bias, group, in_features) -> None:
        self.packed = packed  # uint8, the kernel's layout
        self.scales_zeros = scales_zeros.to(torch.bfloat16)  # [in / group, out, 2]
        self.bias = None if bias is None else bias.float()
        self.group, self.in_features = group, in_features
        self.out_features = int(scales_zeros.shape[1])

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8, scales and zeros float32 [in / group, out, 2]): what the cache keeps."""
        return self.packed, self.scales_zeros.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        y = _LINEAR_INT4(rows, self.packed, self.group, self.scales_zeros).float()  # [M, out]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    banded = __call__
    reference = __call__


_LINEAR_INT4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
INT4_GROUPS = (32, 64, 128, 256)  # what the kernel takes


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs, each group's [min, max] onto 0..15:
    (packed uint8 for the kernel, scales and zeros bf16 [in / group, out, 2]). Q is rounded
    against the bf16 scale and zero the kernel will use, not the float ones."""
    out_features, in_features = weight.shape
    if group not in INT4_GROUPS or in_features % group:
        raise ValueError(
            f"int4 group size must be one of {INT4_GROUPS} and divide the {in_features} "
            f"inputs, got {group}"
        )
    w = weight.float().reshape(out_features, in_features // group, group)
    lo, hi = w.amin(-1), w.amax(-1)  # [out, groups]
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()  # (Q - 8) * scale + zero = lo at Q = 0
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    q = q.reshape(out_features, in_features).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return packed, scales_zeros.to(torch.bfloat16)


INT4_GROUP = 32  # the int4 weights' group size (see docs/benchmarks.md, "int4 on the CPU")
INT8_GROUP = 32  # the int8 weights' group size on smcspec's kernel (docs/benchmarks.md)
Linear = DenseLinear | Int8Linear | AtenInt4Linear | cpu_linear.PackedLinear


def cache_kind(dtype: str) -> str:
    """The weight cache's kind for `dtype` ("int8" or "int4") weights on this machine: smcspec's
    kernel packs them in blocks of 16 outputs; fbgemm's int8 and PyTorch's int4 are stored in
    their own formats."""
    if dtype == "int8":
        return f"int8-b16-g{INT8_GROUP}" if cpu_linear.runs_int8() else "int8"
    return f"int4-b16-g{INT4_GROUP}" if cpu_linear.available() else f"int4-g{INT4_GROUP}"


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: str,
    device: str | torch.device = "cpu",
) -> Linear:
    if dtype == "int8" and not cpu_linear.runs_int8():
        return Int8Linear(weight, bias)
    if dtype in ("int8", "int4"):
        bits, group = (8, INT8_GROUP) if dtype == "int8" else (4, INT4_GROUP)
        if not cpu_linear.available():
            return AtenInt4Linear(weight, bias, group)
        if weight.shape[0] % cpu_linear.LANES or weight.shape[1] % group:
            return Int8Linear(weight, bias)  # a shape the kernel's blocks do not tile
        return cpu_linear.PackedLinear(weight, bias, bits, group)
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return DenseLinear(weight.to(device, dt), None if bias is None else bias.to(device, dt))
