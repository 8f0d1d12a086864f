"""Rotary position embeddings (RoPE) and the context-stretching scalings Llama-family configs name.

A head of dimension D turns each pair of coordinates (i, i + D/2), i < D/2, by the angle
p * inv_freq[i] at position p, with inv_freq[i] = theta^(-2i/D) (Su et al., RoFormer). A model
trained on `original_max_positions` tokens is run on longer contexts by lowering frequencies:

- `linear` (position interpolation, Chen et al. 2023): inv_freq / factor.
- `llama3` (Llama 3.1): wavelengths 2 pi / inv_freq above original / low_freq_factor are
  interpolated (/ factor), those below original / high_freq_factor are kept, and in between the
  two are blended with weight s = (original / wavelength - low) / (high - low) on the kept one.
- `dynamic` (NTK-aware): theta grows once the sequence outgrows max_position_embeddings M:
  theta' = theta * (factor * L / M - (factor - 1))^(D / (D - 2)) for a sequence of length L.
- `yarn` (Peng et al. 2023): per dimension, a blend of interpolated and kept frequencies, the
  weight on the kept one ramping linearly from 1 to 0 between the dimensions that turn beta_fast
  and beta_slow times over the original context; cos and sin are multiplied by an attention
  factor (0.1 ln(factor) + 1 unless set).
- `longrope` (Phi-3, Phi-4-mini; Ding et al. 2024): inv_freq divided by searched per-dimension
  factors, `short_factor` for sequences up to the original context and `long_factor` past it,
  cos and sin times sqrt(1 + ln(factor) / ln(original)). transformers switches to the long
  factors for a whole sequence once it outgrows the original context, rotating its cached keys
  anew; a paged cache keeps the rotation a key was written with, so the native engine runs the
  short factors and refuses positions past the original context (`limit`).

A partial rotary factor (Phi-4-mini's 0.75) turns only the first `dim` of a head's dimensions;
the rest pass unrotated.

The formulas follow transformers' `modeling_rope_utils` and are tested against it. The config
keys are read as transformers 4 (`rope_scaling`, `rope_theta`) and 5 (`rope_parameters`) store
them. A GGUF file's `rope_freqs` tensor (llama.cpp's form of `llama3`) arrives as
`freq_factors`: inv_freq / freq_factors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

SCALINGS = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class Rope:
    """The RoPE of one model: `dim` rotated dimensions per head (all of them unless a partial
    rotary factor), base `theta`, a scaling from SCALINGS and the fields that scaling reads."""

    theta: float
    dim: int
    scaling: str = "default"
    factor: float = 1.0
    # llama3, yarn: the pre-training context; dynamic: max_position_embeddings; else unused.
    original_max_positions: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: widen the ramp's ends to whole dimensions
    attention_factor: float = 1.0  # yarn: multiplies cos and sin, so attention logits by its square
    freq_factors: tuple[float, ...] | None = field(default=None, repr=False)  # [dim/2], GGUF

    @property
    def limit(self) -> int:
        """The positions it holds (0: any): longrope's short factors up to the original context,
        past which transformers would switch to the long ones."""
        return self.original_max_positions if self.scaling == "longrope" else 0


def from_hf(cfg: dict, head_dim: int) -> Rope:
    """The Rope of a Hugging Face style config dict. A scaling outside SCALINGS (or a partial
    rotary factor that leaves an odd number of dimensions) raises ValueError naming it, so a
    model is refused before its weights load."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su" or (kind == "yarn" and cfg.get("model_type") == "phi3"):
        kind = "longrope"  # as transformers' Phi3Config reads Phi-3's older names
    if kind not in SCALINGS:
        raise ValueError(
            f"rope scaling {kind!r} is not supported by the native engine "
            f"(supported: {', '.join(SCALINGS)})"
        )
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    dim = int(head_dim * partial)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {partial} turns {dim} of {head_dim} dimensions: the native "
            "engine needs an even number of them, at least 2"
        )
    factors = cfg.get("rope_freq_factors")
    if factors is not None and len(factors) != dim // 2:
        raise ValueError(f"rope_freq_factors has {len(factors)} values, expected {dim // 2}")
    base = Rope(
        theta=float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        dim=dim,
        freq_factors=None if factors is None else tuple(float(f) for f in factors),
    )
    if kind == "default":
        return base
    max_positions = int(cfg.get("max_position_embeddings") or 4096)
    if kind in ("linear", "dynamic"):
        # dynamic measures a sequence against max_position_embeddings; linear needs no length.
        original = max_positions if kind == "dynamic" else 0
        return _replace(base, kind, _number(params, "factor", kind), original)
    # transformers lets a top-level original_max_position_embeddings (Phi-3's place) win.
    original = int(
        cfg.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_positions
    )
    if kind == "longrope":
        return _longrope_from_hf(base, params, max_positions, original)
    if kind == "llama3":
        return _replace(
            base,
            kind,
            _number(params, "factor", kind),
            original,
            low_freq_factor=_number(params, "low_freq_factor", kind),
            high_freq_factor=_number(params, "high_freq_factor", kind),
        )
    return _yarn_from_hf(base, params, max_positions, original)


def _yarn_from_hf(base: Rope, params: dict, max_positions: int, original: int) -> Rope:
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form: a ratio of two magnitudes
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention = _mscale(factor, 1.0)
    return _replace(
        base,
        "yarn",
        factor,
        original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


def _longrope_from_hf(base: Rope, params: dict, max_positions: int, original: int) -> Rope:
    short = params.get("short_factor")
    if not isinstance(short, list | tuple) or len(short) != base.dim // 2:
        raise ValueError(
            f"rope scaling 'longrope' needs short_factor with {base.dim // 2} values, got {short!r}"
        )
    # as transformers: the factor given, else the context's stretch (Phi-3's way)
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dataclasses.replace(
        base,
        scaling="longrope",
        factor=factor,
        original_max_positions=original,
        attention_factor=float(attention),
        freq_factors=tuple(float(f) for f in short),
    )


def inv_freq(rope: Rope, seq_len: int = 0) -> torch.Tensor:
    """inv_freq [dim/2] (float64); `seq_len` matters to `dynamic` only."""
    return _scaled(rope, _theta(rope, torch.tensor([seq_len])))[0]


def angles(rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """The angle position p turns pair i by, p * inv_freq[i]: [N, dim/2] (float64) for
    positions [N].

    `dynamic` takes theta from the length p + 1 of the sequence ending at p, so a position's
    rotation depends on its prefix alone and the logits do not depend on how the tokens were
    split into forward calls (which speculative and SMC decoding need). This is what
    transformers computes when it decodes one token per call, its cached keys keeping the
    rotation they were written with; one transformers call over a prompt longer than M rotates
    the whole prompt with the theta of its full length instead, so there its logits depend on
    the chunking and no chunk-free model matches it."""
    p = positions.double()[:, None]  # [N, 1]
    return p * _scaled(rope, _theta(rope, positions + 1))  # [N, dim/2]


def _theta(rope: Rope, lengths: torch.Tensor) -> torch.Tensor:
    """The base each sequence length uses: [N, 1], or [1, 1] when it does not vary."""
    if rope.scaling != "dynamic":
        return torch.tensor([[rope.theta]], dtype=torch.float64)
    m, f = rope.original_max_positions, rope.factor
    length = lengths.double().clamp(min=m)[:, None]  # [N, 1]
    return rope.theta * (f * length / m - (f - 1)) ** (rope.dim / (rope.dim - 2))


def _scaled(rope: Rope, theta: torch.Tensor) -> torch.Tensor:
    """inv_freq [N, dim/2] for bases theta [N, 1]."""
    exponents = torch.arange(0, rope.dim, 2, dtype=torch.float64) / rope.dim  # 2i / D
    freqs = theta ** -exponents[None, :]
    if rope.scaling == "linear":
        freqs = freqs / rope.factor
    elif rope.scaling == "llama3":
        freqs = _llama3(rope, freqs)
    elif rope.scaling == "yarn":
        freqs = _yarn(rope, freqs)
    if rope.freq_factors is not None:
        freqs = freqs / torch.tensor(rope.freq_factors, dtype=torch.float64)
    return freqs


def _llama3(rope: Rope, freqs: torch.Tensor) -> torch.Tensor:
    """Keep high frequencies, interpolate low ones, blend the band between (Llama 3.1)."""
    low, high = rope.low_freq_factor, rope.high_freq_factor
    # s = 0 at wavelength original / low (interpolate fully), 1 at original / high (keep).
    wavelength = 2 * math.pi / freqs
    s = ((rope.original_max_positions / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - s) * freqs / rope.factor + s * freqs


def _yarn(rope: Rope, freqs: torch.Tensor) -> torch.Tensor:
    """YaRN's "NTK-by-parts": dimension i keeps its frequency with weight 1 - ramp(i), where the
    ramp rises from 0 to 1 between the dimensions that turn beta_fast and beta_slow times over
    the original context: fast-turning pairs extrapolate, slow ones interpolate."""
    low = _yarn_dimension(rope, rope.beta_fast)
    high = _yarn_dimension(rope, rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope.dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    i = torch.arange(rope.dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)  # 0: keep, 1: interpolate
    return ramp * freqs / rope.factor + (1 - ramp) * freqs


def _yarn_dimension(rope: Rope, rotations: float) -> float:
    """The (fractional) pair index i whose wavelength fits `rotations` times into the original
    context: original * theta^(-2i/D) = 2 pi rotations, solved for i."""
    turns = rope.original_max_positions / (2 * math.pi * rotations)
    return rope.dim * math.log(turns) / (2 * math.log(rope.theta))


def _mscale(factor: float, scale: float) -> float:
    """YaRN's attention magnitude sqrt(1/t) = 0.1 ln(factor) + 1, here weighted by `scale`."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def _number(params: dict, key: str, kind: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"rope scaling {kind!r} needs a number for {key}, got {value!r}")
    return float(value)


def _replace(base: Rope, kind: str, factor: float, original: int, **fields) -> Rope:
    return dataclasses.replace(
        base, scaling=kind, factor=factor, original_max_positions=original, **fields
    )
