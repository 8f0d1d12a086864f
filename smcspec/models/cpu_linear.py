"""int4 and int8 weights on smcspec's own CPU kernel (`csrc/cpu_linear.cpp`): int4 or int8
weights per group times int8 activations per group, summed by the CPU's integer dot-product
instructions (AVX-512 VNNI, else AVX2), as llama.cpp does for its quantized formats.

Why not PyTorch's `_weight_int4pack_mm_for_cpu` (`layers.AtenInt4Linear`, the fallback where no
compiler builds this one): it multiplies bf16 activations and costs nearly a row's worth of time
per row (measured on 2 Xeon cores: 0.61 ms for one row of gate/up, 5.18 ms for 32), so a
verification of N x (K+1) rows costs nearly N x (K+1) decode steps. This kernel reads a block's
weights once for every row it multiplies.

Why not fbgemm for int8 (`layers.Int8Linear`, the fallback): its packed weights are no tensors
that can be stored, so every load repacks them (8 of a warm int8 start's 12.5 s on 2 Xeon
cores); this kernel's packed weights are plain tensors, read back from the weight cache as they
are.

W[n, k] ~= Q[n, k] * scale[n, g] + lo[n, g], g = k // group, scale and lo in float16: each
group's [min, max] mapped onto 0..15 (int4) or 0..255 (int8).

The kernel is built once per machine with the C++ compiler (`-march=native`) into the smcspec
cache, the first time such weights are loaded.

On an Intel Xeon with AMX (Sapphire Rapids and later) the kernel multiplies several rows on the
CPU's tile unit, where Linux grants the process its tiles (asked once; a refusal is said once and
the vector path runs): int8 tiles from `AMX_ROWS[bits][0]` rows up, with the same sums as the
vector path to the bit; bf16 tiles of de-quantized weights from `AMX_ROWS[bits][1]` rows up
(prefill), which round the rows to bf16 instead of int8 per group. Measured on 2 Xeon cores
(docs/benchmarks.md, "AMX"). `SMCSPEC_AMX=off` keeps every product on the vector path.

The same build holds the CPU's attention for models whose products run here (`attend`,
`csrc/cpu_attention.cpp`): every query row computed alone, so that a row's result does not
depend on what else shares its pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from smcspec.models import defaults

LANES = 16  # outputs per block of the packed layout
SUB = {4: 8, 8: 4}  # inputs per sub-block of 64 bytes, by bits per weight
GROUPS = (32, 64, 128, 256)  # group sizes offered (the kernel takes any multiple of 8)
# the products; the attention and the RMSNorms, whose rows do not depend on their pass
_SOURCES = tuple(
    Path(__file__).with_name("csrc") / f
    for f in ("cpu_linear.cpp", "cpu_attention.cpp", "cpu_norm.cpp")
)
# by weight bits: the rows from which products run on AMX int8 tiles and on bf16 tiles, from
# `scripts/cpu_kernels` on 2 Xeon cores at Qwen2.5-1.5B's shapes (benchmarks/cpu/amx/kernels.md):
# int4's int8 tiles need unpacking and lead from 16 rows, int8's from 8; bf16 tiles pay a
# de-quantization per weight whatever the rows and lead from 64 rows (int4) and 128 (int8)
AMX_ROWS = {4: (16, 64), 8: (8, 128)}
# -fopenmp: ATen's parallel_for is OpenMP inside torch, and compiled without it runs on one
# thread (the extension then shares torch's own libgomp, loaded first under the same name)
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


class _Kernel:
    """The built extension, or None where it cannot be built (said once, as a warning) or where
    SMCSPEC_CPU_KERNEL=off asks for the fallbacks (fbgemm's int8, PyTorch's int4)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._module: ModuleType | None = None
        self._early: threading.Thread | None = None

    def start(self) -> None:
        """Build (or load) it on a thread now; `get` waits for that build. A cold start builds
        it (25 s) while the models download and convert, on the other core. The thread is no
        daemon: interrupted, the process waits for torch's build to give its lock back (a lock
        left behind would hold the next start's build for 10 minutes)."""
        with self._lock:
            if self._tried or self._early is not None:
                return
            self._early = threading.Thread(target=self._load, name="smcspec-kernel-build")
            self._early.start()

    def get(self) -> ModuleType | None:
        if self._early is not None:
            self._early.join()
        return self._load()

    def _load(self) -> ModuleType | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._module = None if _turned_off("SMCSPEC_CPU_KERNEL") else _build()
                if self._module is not None:
                    _set_amx(self._module)
            return self._module


def _set_amx(kernel: ModuleType) -> None:
    """The rows from which products run on AMX tiles, or never (`SMCSPEC_AMX=off`, no AMX); a
    CPU that lists AMX whose tiles the process is refused is said once."""
    off = _turned_off("SMCSPEC_AMX")
    why = kernel.amx()
    for bits, (tiles, bf16) in AMX_ROWS.items():
        kernel.set_amx_rows(bits, 0 if off else tiles, 0 if off else bf16)
    if why and not off and "amx_int8" in _cpu_flags():
        print(f"smcspec: AMX not used ({why}); the AVX-512 path runs", file=sys.stderr)


def matrix_engine() -> str:
    """What the kernel multiplies several rows on here: "amx", or the vector instruction set
    (`isa()`), or "none" where the kernel is not built."""
    kernel = KERNEL.get()
    if kernel is None:
        return "none"
    return "amx" if kernel.amx() == "" and not _turned_off("SMCSPEC_AMX") else kernel.isa()


def _turned_off(variable: str) -> bool:
    """Whether the environment sets `variable` to 0, off or no."""
    return os.environ.get(variable, "").lower() in ("0", "off", "no")


def _flags_line() -> str | None:
    """/proc/cpuinfo's first line of flags ("" where it has none), None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((ln for ln in text.splitlines() if ln.startswith("flags")), "")


def _cpu_flags() -> set[str]:
    return set((_flags_line() or "").split()[2:])


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    name = f"smcspec_cpu_{build_key()}"
    where = defaults.cache_root() / "kernels" / name
    if not (where / f"{name}.so").exists():
        print("smcspec: building the int4/int8 CPU kernel for this machine (once)", file=sys.stderr)
    try:
        where.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(where / "lock")
        return cpp_extension.load(
            name=name,
            sources=[str(_source_in(where, source)) for source in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(where),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no headers, a failed build
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"smcspec's int4/int8 CPU kernel could not be built ({reason}); int4 runs on "
            "PyTorch's slower kernel and int8 on fbgemm instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _source_in(where: Path, source: Path) -> Path:
    """A source of the kernel, copied into its build folder. torch's build (ninja) compiles again
    whenever a source's path changes, and the folder is shared by every install of the same
    source (its name hashes the bytes): two checkouts or environments on one machine, each
    naming its own copy, rebuilt the kernel (25 s) at every start that followed the other's."""
    copy = where / source.name
    if not copy.is_file() or copy.read_bytes() != source.read_bytes():
        partial = copy.with_name(f"{copy.name}.partial-{os.getpid()}")
        shutil.copyfile(source, partial)
        os.replace(partial, copy)
    return copy


def _drop_stale_lock(lock: Path, older_than_s: float = 600.0) -> None:
    """torch's build waits for as long as another build's lock file stands; a build takes under
    a minute, so a lock left by a killed one is removed rather than waited on for ever."""
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink()


def build_key() -> str:
    """What the built kernel depends on: its source, torch, and this CPU's instruction sets
    (`-march=native`), so a cache shared between machines never runs another CPU's build."""
    h = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES) + " ".join(_FLAGS).encode())
    h.update(f"{torch.__version__} {platform.machine()} {sys.version_info[:2]}".encode())
    flags = _flags_line()
    h.update((platform.processor() if flags is None else flags).encode())
    return h.hexdigest()[:12]


KERNEL = _Kernel()


def build_early() -> None:
    """Start the kernel's build on a thread (see `_Kernel.start`), where it is not turned off."""
    if not _turned_off("SMCSPEC_CPU_KERNEL"):
        KERNEL.start()


def available() -> bool:
    """Whether this machine runs the kernel (built here, now, if it was not yet)."""
    return KERNEL.get() is not None


def runs_int8() -> bool:
    """Whether int8 weights run on this kernel: where it was built with AVX-512 VNNI, one
    instruction per 4 inputs of a row, which measured as fast as fbgemm at one row and faster
    at 4-16 (2 Xeon cores). Built for AVX2 alone it takes an int8 weight as two nibbles, about
    twice fbgemm's work per row, not measured against it: there int8 stays on fbgemm."""
    kernel = KERNEL.get()
    return kernel is not None and kernel.isa() == "avx512-vnni"


def quantize(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric `bits`-bit weights per group of `group` inputs, each group's [min, max] onto
    0..2^bits - 1: (packed uint8 [N / 16, K / SUB[bits], 64], scales float16 [N / 16, K / group,
    2, 16]) in the kernel's layout (see `pack`). Q is rounded against the float16 scale and lo
    the kernel will use."""
    n_out, k_in = weight.shape
    if group not in GROUPS or k_in % group:
        raise ValueError(
            f"int{bits} group size must be one of {GROUPS} and divide the {k_in} inputs, "
            f"got {group}"
        )
    if n_out % LANES:
        raise ValueError(f"the int{bits} kernel needs outputs in blocks of {LANES}, got {n_out}")
    top = 2**bits - 1
    w = weight.float().reshape(n_out, k_in // group, group)
    lo, hi = w.amin(-1), w.amax(-1)  # [N, G]
    scale = ((hi - lo) / top).clamp_min(2.0**-14).half().float()  # float16's smallest normal
    lo = lo.half().float()
    # in place after the first: the output layer's float matrix is 0.9 GB for a 1.5B model
    q = (w - lo[..., None]).div_(scale[..., None]).round_().clamp_(0, top).to(torch.uint8)
    return pack(q.reshape(n_out, k_in), bits), pack_scales(scale, lo)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Q uint8 [N, K] -> [N / 16, K / SUB[bits], 64]. int4 (Q in 0..15): per block of 16 outputs
    and sub-block of 8 inputs, byte 4 l + i holds Q[l, i] low and Q[l, 4 + i] high (l the output
    in the block). int8: per sub-block of 4 inputs, byte 4 l + i holds Q[l, i]."""
    n_out, k_in = q.shape
    if bits == 8:
        q = q.reshape(n_out // LANES, LANES, k_in // 4, 4).permute(0, 2, 1, 3)  # [b, sub, l, i]
        return q.reshape(n_out // LANES, k_in // 4, 4 * LANES).contiguous()
    q = q.reshape(n_out // LANES, LANES, k_in // 8, 2, 4)  # [blocks, lane, sub, half, i]
    q = q.permute(0, 2, 1, 4, 3)  # [blocks, sub, lane, i, half]
    return (q[..., 0] | (q[..., 1] << 4)).reshape(n_out // LANES, k_in // 8, 4 * LANES)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack`'s inverse: Q uint8 [N, K]."""
    blocks, subs, _ = packed.shape
    b = packed.reshape(blocks, subs, LANES, 4)
    if bits == 8:
        return b.permute(0, 2, 1, 3).reshape(blocks * LANES, subs * 4)
    q = torch.stack([b & 0x0F, b >> 4], -1)  # [blocks, sub, lane, i, half]
    return q.permute(0, 2, 1, 4, 3).reshape(blocks * LANES, subs * 8)


def pack_scales(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """scale, lo [N, G] -> float16 [N / 16, G, 2, 16]."""
    n_out, groups = scale.shape
    both = torch.stack([scale, lo], 0).reshape(2, n_out // LANES, LANES, groups)
    return both.permute(1, 3, 0, 2).contiguous().half()


def dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 weights [N, K] that `packed` and `scales` stand for."""
    q = unpack(packed, bits).float()
    blocks, groups = scales.shape[:2]
    sl = scales.float().permute(2, 0, 3, 1).reshape(2, blocks * LANES, groups)  # [2, N, G]
    group = q.shape[1] // groups
    return q * sl[0].repeat_interleave(group, 1) + sl[1].repeat_interleave(group, 1)


def magnitude_bands(x: torch.Tensor) -> torch.Tensor:
    """One row x [1, K] split by magnitude into rows [bands, K] that sum to it, each holding the
    entries within a factor 2 of each other (entries below 2^-12 of the peak share the last
    row): quantized to int8 at its own peak, each entry is rounded within 2/255 of itself."""
    x = x.reshape(1, -1).float()
    mag = x[0].abs()
    peak = float(mag.max())
    if peak == 0.0:
        return x
    band = torch.floor(torch.log2(mag.clamp_min(peak * 2.0**-12) / peak)).clamp_(min=-12)
    levels = torch.unique(band[mag > 0])  # [bands]
    return torch.where(band[None, :] == levels[:, None], x, 0.0)


class PackedLinear:
    """y = x W^T + b with W int4 or int8 per group on this CPU kernel; the activations are
    quantized to int8 per group of inputs inside the call, so a loud entry (the attention sink)
    coarsens only its own group. Its tensors are plain ones: the weight cache stores them as they
    are."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 4,
        group: int = 32,
    ) -> None:  # fmt: skip
        packed, scales = quantize(weight, bits, group)
        self._set(packed, scales, bias, bits, group)

    @classmethod
    def from_quantized(
        cls, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, bits: int
    ) -> PackedLinear:
        """From `quantized()`'s tensors."""
        linear = cls.__new__(cls)
        linear._set(packed, scales, bias, bits, packed.shape[1] * SUB[bits] // scales.shape[1])
        return linear

    def _set(self, packed, scales, bias, bits, group) -> None:
        kernel = KERNEL.get()
        if kernel is None:
            raise RuntimeError("smcspec's int4/int8 CPU kernel is not built on this machine")
        self._linear = kernel.linear
        self.packed, self.scales = packed.contiguous(), scales.contiguous()
        self.bias = None if bias is None else bias.float()
        self.bits, self.group = bits, group
        self.out_features, self.in_features = packed.shape[0] * LANES, packed.shape[1] * SUB[bits]

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8 [N / 16, K / SUB[bits], 64], scales float16 [N / 16, G, 2, 16])."""
        return self.packed, self.scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        y = self._linear(rows, self.packed, self.scales, self.group, self.bits)  # [M, N]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def banded(self, x: torch.Tensor) -> torch.Tensor:
        """One row x [1, in] with a huge dynamic range (the attention sink), split by magnitude
        (`magnitude_bands`) into rows the kernel multiplies at once: every entry is rounded
        within 2/255 of itself, not to a step of its group's loudest entry."""
        rows = magnitude_bands(x)
        y = self._linear(rows, self.packed, self.scales, self.group, self.bits).sum(0, True)
        return y if self.bias is None else y.add_(self.bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same weights in float32, activations unquantized."""
        y = torch.nn.functional.linear(x.float(), dequantize(self.packed, self.scales, self.bits))
        return y if self.bias is None else y + self.bias
