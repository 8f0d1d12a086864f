"""Weights and config of a Llama-family model from a GGUF file, de-quantized to torch tensors
with Hugging Face parameter names, for the native model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ARCHITECTURES = ("llama", "qwen2", "mistral")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def read(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF-style config dict, HF-named weights) from a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {ARCHITECTURES})"
        )
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the innermost dim first
        weights[name] = torch.from_numpy(np.array(array, copy=True).reshape(shape)).to(dtype)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    if arch in ("llama", "mistral"):  # llama.cpp's converter permutes q/k rows for its RoPE
        for key, value in list(weights.items()):
            if key.endswith("q_proj.weight"):
                weights[key] = _unpermute(value, heads)
            elif key.endswith("k_proj.weight"):
                weights[key] = _unpermute(value, kv_heads)
    config = {
        "model_type": arch,
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "hidden_size": int(_field(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
    }
    return config, weights


def architecture(path: str | Path) -> str | None:
    """general.architecture of a GGUF file (memory-mapped, no tensor is read)."""
    import gguf

    try:
        return str(_field(gguf.GGUFReader(str(path)), "general.architecture"))
    except (ValueError, OSError):
        return None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file lacks {key}")
        return default
    return field.contents()


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's (heads, 2, d/2) -> (heads, d/2, 2) row interleave of q/k weights."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
