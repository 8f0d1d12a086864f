"""Weights and config of a Llama-family model from a GGUF file, de-quantized to torch tensors
with Hugging Face parameter names, for the native model.

The weights are read lazily (`GGUFWeights`): a tensor is de-quantized when it is asked for, a
chunk of rows at a time from the file, so that a reader holds one float tensor, never a whole
float model (Qwen2.5-Coder-1.5B: 7.1 GB in float32, its largest tensor 0.93 GB).

The metadata and tensor table come from `gguf_header.Header`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from smcspec.models.gguf_header import Header

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: q, k and v in one matrix
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "smollm3", "olmo2")
# Layer tensors an architecture names otherwise: phi3's ffn_up holds gate and up, in that order
# (transformers' gate_up_proj); gemma3's four norms a layer sit before and after the attention
# and the MLP, its ffn_norm the one before the MLP; olmo2 has only the two after.
_LAYER_BY_ARCH = {
    "olmo2": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
# llama.cpp's converter permutes the q/k rows of Llama and the models it converts as Llama's
_PERMUTED = ("llama", "mistral", "smollm3")
# llama.cpp's converter stores a Gemma norm's scale 1 + w where transformers stores w: the
# loader takes the 1 back off, so that the weights mean what their Hugging Face names do.
_NORM_SHIFT = {"gemma3": 1.0}
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # transformers' name where it differs from llama.cpp's
# what llama.cpp fixes in code for gemma3 rather than writes: every 6th layer attends globally,
# the sliding layers' RoPE base is 10k, and scores are scaled by 1/sqrt(head_dim), but for the
# 27B model (62 layers), by 1/sqrt(hidden / heads)
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10000.0, 62


def hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    layer = _LAYER | _LAYER_BY_ARCH.get(arch, {})
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None


def read(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict, GGUFWeights]:
    """(HF-style config dict, HF-named weights, de-quantized as they are read) from a GGUF file."""
    return config(path), weights(path, dtype)


def _supported(reader: Header) -> str:
    """The file's general.architecture, where this reader runs it; ValueError otherwise."""
    arch = str(reader.field("general.architecture"))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by the native engine's GGUF "
            f"reader (it reads {', '.join(ARCHITECTURES)}); a safetensors folder of the "
            "model may run"
        )
    return arch


def config(path: str | Path) -> dict:
    """The HF-style config dict of a GGUF file, from its metadata (no weight is de-quantized).

    RoPE scaling is carried over, never dropped: `{arch}.rope.scaling.*` (linear, yarn) becomes
    `rope_scaling`, and the `rope_freqs` tensor llama.cpp writes for Llama 3.1-style (`llama3`)
    scaling becomes `rope_freq_factors` (inv_freq is divided by them)."""
    reader = Header.read(path)
    arch = _supported(reader)
    tensors = reader.tensors
    heads = int(reader.field(f"{arch}.attention.head_count"))
    hidden = int(reader.field(f"{arch}.embedding_length"))
    head_dim = int(reader.field(f"{arch}.attention.key_length", hidden // heads))
    cfg = {
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),  # [vocab, hidden]
        "hidden_size": hidden,
        "head_dim": head_dim,
        "intermediate_size": int(reader.field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(reader.field(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(reader.field(f"{arch}.attention.head_count_kv", heads)),
        "rope_theta": float(reader.field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(reader.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": int(reader.field(f"{arch}.context_length", 4096)),
    }
    rotated = int(reader.field(f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:  # Phi-4-mini's partial rotary factor (`rope.from_hf` checks it)
        cfg["partial_rotary_factor"] = rotated / head_dim
    if arch == "phi3":
        cfg.update(_phi3(reader, path))
        return cfg
    if arch == "gemma3":
        cfg.update(_gemma3(cfg, int(reader.field("gemma3.attention.sliding_window", 0))))
    if arch == "olmo2" and reader.field("olmo2.attention.sliding_window", 0):
        raise ValueError(
            f"{Path(path).name}: an olmo2 file with sliding-window layers (OLMo 3); the native "
            "engine runs OLMo 2's full attention only"
        )
    scaling = rope_scaling(reader, arch)
    if scaling:
        cfg["rope_scaling"] = scaling
    if "rope_freqs.weight" in tensors:
        cfg["rope_freq_factors"] = _values(reader, path, "rope_freqs.weight")
    return cfg


def _values(reader: Header, path: str | Path, name: str) -> list[float]:
    """A small tensor of the file (RoPE factors) as a flat list of floats."""
    t = reader.tensors[name]
    return (
        _dequantize(Path(path), _Stored(t.qtype, t.shape, t.offset, t.nbytes, 0)).ravel().tolist()
    )


def _phi3(reader: Header, path: str | Path) -> dict:
    """A phi3 file's sliding window (0: none, llama.cpp's mark of Phi-4) and longrope: its
    factor tensors, original context and attention factor, as transformers' config names them."""
    out: dict = {
        "sliding_window": int(reader.field("phi3.attention.sliding_window", 0)) or None,
        "original_max_position_embeddings": int(
            reader.field("phi3.rope.scaling.original_context_length", 0)
        )
        or None,
    }
    if "rope_factors_short.weight" not in reader.tensors:
        return out
    out["rope_scaling"] = {
        "rope_type": "longrope",
        **{
            f"{k}_factor": _values(reader, path, f"rope_factors_{k}.weight")
            for k in ("short", "long")
        },
        "attention_factor": float(reader.field("phi3.rope.scaling.attn_factor", 1.0)),
    }
    return out


def _gemma3(cfg: dict, window: int) -> dict:
    """A gemma3 file's settings as transformers' Gemma3TextConfig names them, those its
    metadata leaves out set as llama.cpp sets them."""
    layers = cfg["num_hidden_layers"]
    wide = layers == GEMMA3_27B_LAYERS
    return {
        "model_type": _MODEL_TYPE["gemma3"],
        "sliding_window": window or None,
        "sliding_window_pattern": GEMMA3_PATTERN,
        "rope_local_base_freq": GEMMA3_LOCAL_BASE,
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
        if wide
        else cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def weights(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFWeights:
    """The weights of a GGUF file under their Hugging Face names, each de-quantized when read."""
    return GGUFWeights(path, dtype)


@dataclass(frozen=True)
class _Stored:
    """Where a tensor lies in the file, and how it is stored."""

    qtype: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (ggml lists the innermost dim first)
    offset: int  # of its first byte in the file
    nbytes: int
    heads: int  # llama.cpp permuted its rows for this many heads (Llama q/k); 0: not permuted
    shift: float = 0.0  # llama.cpp added this to the values (Gemma's norms); taken off on reading


# Rows de-quantized at once hold about this many output bytes: gguf's de-quantizers make a few
# temporaries of the output's size, which stay this small while the output fills.
CHUNK_BYTES = 1 << 23


class GGUFWeights:
    """A GGUF file's weights under their Hugging Face names, each de-quantized (in `dtype`) when
    `[]` or `pop` asks for it, from the file's bytes, never all at once. The bytes are read, not
    memory-mapped: pages of a mapping stay resident as long as the mapping does, and would add
    the whole quantized file to the reader's memory.

    Values are those of `gguf.quants.dequantize` on the whole tensor (the de-quantizers work block
    by block), with llama.cpp's q/k row permutation undone (`_PERMUTED`) and the 1 it adds to
    Gemma's norm scales taken off."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        reader = Header.read(path)
        arch = _supported(reader)
        heads = int(reader.field(f"{arch}.attention.head_count"))
        kv_heads = int(reader.field(f"{arch}.attention.head_count_kv", heads))
        permuted = {"q_proj.weight": heads, "k_proj.weight": kv_heads}
        self.path, self.dtype = Path(path), dtype
        self._stored: dict[str, _Stored] = {}
        for t in reader.tensors.values():
            name = hf_name(t.name, arch)
            if name is None:
                continue
            permute = arch in _PERMUTED
            rows = next((n for s, n in permuted.items() if permute and name.endswith(s)), 0)
            shift = _NORM_SHIFT.get(arch, 0.0) if name.endswith("norm.weight") else 0.0
            self._stored[name] = _Stored(t.qtype, t.shape, t.offset, t.nbytes, rows, shift)

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self._stored[name]
        out = torch.from_numpy(_dequantize(self.path, stored))  # shape: stored.shape
        if stored.heads:
            out = _unpermute(out, stored.heads)
        if stored.shift:
            out -= stored.shift
        return out.to(self.dtype)

    def pop(self, name: str) -> torch.Tensor:
        tensor = self[name]
        del self._stored[name]
        return tensor

    def keys(self) -> Iterator[str]:
        return iter(list(self._stored))

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name].shape


def _dequantize(path: Path, stored: _Stored) -> np.ndarray:
    """The float32 values of one stored tensor [*stored.shape], read and de-quantized a chunk of
    rows at a time (a ggml row is whole blocks, so rows de-quantize apart)."""
    import gguf

    out = np.empty(stored.shape, np.float32)
    rows = out.reshape(-1, stored.shape[-1])  # [rows, cols], a view of `out`
    row_bytes = stored.nbytes // rows.shape[0]
    step = max(1, CHUNK_BYTES // (4 * rows.shape[1]))
    with open(path, "rb") as f:
        f.seek(stored.offset)
        for start in range(0, rows.shape[0], step):
            count = min(step, rows.shape[0] - start)
            raw = np.fromfile(f, np.uint8, count * row_bytes).reshape(count, row_bytes)
            values = gguf.quants.dequantize(raw, stored.qtype)  # [count, cols]
            rows[start : start + count] = values.reshape(count, -1)
    return out


def has_rope_scaling(path: str | Path) -> bool:
    """Whether a GGUF file scales RoPE, by metadata or a `rope_freqs` tensor."""
    reader = Header.read(path)
    if "rope_freqs.weight" in reader.tensors or "rope_factors_short.weight" in reader.tensors:
        return True
    try:
        return bool(rope_scaling(reader, _supported(reader)))
    except ValueError:  # keys the native engine cannot map still scale RoPE
        return True


# llama.cpp's yarn keys and their transformers names; "finetuned" records training only.
_YARN_KEYS = {
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def rope_scaling(reader: Header, arch: str) -> dict:
    """`{arch}.rope.scaling.*` as a transformers `rope_scaling` dict ({} for none). llama.cpp
    applies `factor` (or the older `rope.scale_linear`) as a linear scaling unless the type is
    yarn. A type the native engine lacks passes through for `rope.from_hf` to refuse by name; a
    key whose meaning differs between llama.cpp and transformers (yarn's attn_factor,
    log_multiplier, ...) raises ValueError rather than be guessed at."""
    prefix = f"{arch}.rope.scaling."
    keys = {k[len(prefix) :]: reader.field(k) for k in reader.metadata if k.startswith(prefix)}
    kind = str(keys.pop("type", "none"))
    keys.pop("finetuned", None)
    factor = float(keys.pop("factor", reader.field(f"{arch}.rope.scale_linear", 1.0)))
    if kind in ("none", "linear"):
        scaling = {"rope_type": "linear", "factor": factor} if factor not in (0.0, 1.0) else {}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        scaling.update({hf: keys.pop(g) for g, hf in _YARN_KEYS.items() if g in keys})
    else:
        return {"rope_type": kind}
    if keys:
        names = ", ".join(prefix + k for k in sorted(keys))
        raise ValueError(f"GGUF rope scaling keys not supported by the native engine: {names}")
    return scaling


def architecture(path: str | Path) -> str | None:
    """The transformers model type of a GGUF file's general.architecture (its header read, no
    tensor: gemma3's text model is gemma3_text), or None for a file that is no readable GGUF."""
    try:
        arch = str(Header.read(path).field("general.architecture"))
    except (ValueError, OSError):
        return None
    return _MODEL_TYPE.get(arch, arch)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's (heads, 2, d/2) -> (heads, d/2, 2) row interleave of q/k weights."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
