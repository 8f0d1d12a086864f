"""int4 weights on smcspec's own CPU kernel (`csrc/int4_linear.cpp`): int4 weights per group
times int8 activations per group, summed by the CPU's integer dot-product instructions (AVX-512
VNNI, else AVX2), as llama.cpp does for its 4-bit formats.

Why not PyTorch's `_weight_int4pack_mm_for_cpu` (`layers.AtenInt4Linear`, the fallback where no
compiler builds this one): it multiplies bf16 activations and costs nearly a row's worth of time
per row (measured on 2 Xeon cores: 0.61 ms for one row of gate/up, 5.18 ms for 32), so a
verification of N x (K+1) rows costs nearly N x (K+1) decode steps. This kernel reads a block's
weights once for every row it multiplies.

W[n, k] ~= Q[n, k] * scale[n, g] + lo[n, g], Q in 0..15, g = k // group, scale and lo in float16:
each group's [min, max] mapped onto 0..15.

The kernel is built once per machine with the C++ compiler (`-march=native`) into the smcspec
cache, the first time int4 weights are loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from smcspec.models import defaults

LANES = 16  # outputs per block of the packed layout
SUB = 8  # inputs per sub-block
GROUPS = (32, 64, 128, 256)  # group sizes offered (the kernel takes any multiple of 8)
_SOURCE = Path(__file__).with_name("csrc") / "int4_linear.cpp"
# -fopenmp: ATen's parallel_for is OpenMP inside torch, and compiled without it runs on one
# thread (the extension then shares torch's own libgomp, loaded first under the same name)
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


class _Kernel:
    """The built extension, or None where it cannot be built (said once, as a warning)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._module: ModuleType | None = None

    def get(self) -> ModuleType | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._module = _build()
            return self._module


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    name = f"smcspec_int4_{_build_key()}"
    where = defaults.cache_root() / "kernels" / name
    if not (where / f"{name}.so").exists():
        print("smcspec: building the int4 CPU kernel for this machine (once)", file=sys.stderr)
    try:
        where.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(where / "lock")
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(where),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no headers, a failed build
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"int4: smcspec's CPU kernel could not be built ({reason}); int4 runs on "
            "PyTorch's slower kernel instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _drop_stale_lock(lock: Path, older_than_s: float = 600.0) -> None:
    """torch's build waits for as long as another build's lock file stands; a build takes under
    a minute, so a lock left by a killed one is removed rather than waited on for ever."""
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink()


def _build_key() -> str:
    """What the built kernel depends on: its source, torch, and this CPU's instruction sets
    (`-march=native`), so a cache shared between machines never runs another CPU's build."""
    h = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode())
    h.update(f"{torch.__version__} {platform.machine()} {sys.version_info[:2]}".encode())
    try:
        flags = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln[:5] == "flags"]
        h.update(flags[0].encode() if flags else b"")
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:12]


KERNEL = _Kernel()


def available() -> bool:
    """Whether this machine runs the kernel (built here, now, if it was not yet)."""
    return KERNEL.get() is not None


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs, each group's [min, max] onto 0..15:
    (packed uint8 [N / 16, K / 8, 64], scales float16 [N / 16, K / group, 2, 16]) in the kernel's
    layout (see `pack`). Q is rounded against the float16 scale and lo the kernel will use."""
    n_out, k_in = weight.shape
    if group not in GROUPS or k_in % group:
        raise ValueError(
            f"int4 group size must be one of {GROUPS} and divide the {k_in} inputs, got {group}"
        )
    if n_out % LANES:
        raise ValueError(f"the int4 kernel needs outputs in blocks of {LANES}, got {n_out}")
    w = weight.float().reshape(n_out, k_in // group, group)
    lo, hi = w.amin(-1), w.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15).clamp_min(2.0**-14).half().float()  # float16's smallest normal
    lo = lo.half().float()
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return pack(q.reshape(n_out, k_in)), pack_scales(scale, lo)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Q uint8 [N, K] in 0..15 -> [N / 16, K / 8, 64]: per block of 16 outputs and sub-block of
    8 inputs, byte 4 l + i holds Q[l, i] low and Q[l, 4 + i] high (l the output in the block)."""
    n_out, k_in = q.shape
    q = q.reshape(n_out // LANES, LANES, k_in // SUB, 2, 4)  # [blocks, lane, sub, half, i]
    q = q.permute(0, 2, 1, 4, 3)  # [blocks, sub, lane, i, half]
    return (q[..., 0] | (q[..., 1] << 4)).reshape(n_out // LANES, k_in // SUB, 4 * LANES)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: Q uint8 [N, K]."""
    blocks, subs, _ = packed.shape
    b = packed.reshape(blocks, subs, LANES, 4)
    q = torch.stack([b & 0x0F, b >> 4], -1)  # [blocks, sub, lane, i, half]
    return q.permute(0, 2, 1, 4, 3).reshape(blocks * LANES, subs * SUB)


def pack_scales(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """scale, lo [N, G] -> float16 [N / 16, G, 2, 16]."""
    n_out, groups = scale.shape
    both = torch.stack([scale, lo], 0).reshape(2, n_out // LANES, LANES, groups)
    return both.permute(1, 3, 0, 2).contiguous().half()


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that `packed` and `scales` stand for."""
    q = unpack(packed).float()
    blocks, groups = scales.shape[:2]
    sl = scales.float().permute(2, 0, 3, 1).reshape(2, blocks * LANES, groups)  # [2, N, G]
    group = q.shape[1] // groups
    return q * sl[0].repeat_interleave(group, 1) + sl[1].repeat_interleave(group, 1)


class Int4Linear:
    """y = x W^T + b with W int4 per group on this CPU kernel; the activations are quantized to
    int8 per group of inputs inside the call, so a loud entry (the attention sink) coarsens only
    its own group. Its tensors are plain ones: the weight cache stores them as they are."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32):
        packed, scales = quantize(weight, group)
        self._set(packed, scales, bias, group)

    @classmethod
    def from_quantized(
        cls, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> Int4Linear:
        """From `quantized()`'s tensors."""
        linear = cls.__new__(cls)
        linear._set(packed, scales, bias, packed.shape[1] * SUB // scales.shape[1])
        return linear

    def _set(self, packed, scales, bias, group) -> None:
        kernel = KERNEL.get()
        if kernel is None:
            raise RuntimeError("the int4 CPU kernel is not built on this machine")
        self._linear = kernel.int4_linear
        self.packed, self.scales = packed.contiguous(), scales.contiguous()
        self.bias = None if bias is None else bias.float()
        self.group = group
        self.out_features, self.in_features = packed.shape[0] * LANES, packed.shape[1] * SUB

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8 [N / 16, K / 8, 64], scales float16 [N / 16, G, 2, 16])."""
        return self.packed, self.scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        y = self._linear(rows, self.packed, self.scales, self.group)  # [M, N]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    banded = __call__

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same int4 weights in float32, activations unquantized."""
        y = torch.nn.functional.linear(x.float(), dequantize(self.packed, self.scales))
        return y if self.bias is None else y + self.bias
