"""The shapes and settings of a native Llama-family model (`llama.LlamaModel`), read from a
Hugging Face config or a GGUF file's metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from smcspec.models import rope


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: rope.Rope
    rms_eps: float
    qkv_bias: bool
    tie_embeddings: bool
    max_positions: int = 4096
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's d of q and k, before RoPE
    window: int = 0  # Phi-3, Gemma 3: sliding-window attention over this many keys (0: none)
    # Gemma 3 (`gemma3_text`): embeddings times sqrt(hidden); norms stored as w for a scale of
    # 1 + w (`norm_offset`, added at load); a norm after the attention and after the MLP as well
    # as before each; GeLU (tanh) in the MLP; scores scaled by query_pre_attn_scalar^-1/2, as
    # `query_scale` times the usual head_dim^-1/2; its sliding layers on a RoPE of their own.
    embed_scale: float = 1.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    # OLMo 2: norms after the attention and after the MLP only (`sandwich_norms` without the
    # ones before: `pre_norms` False), and q and k each normed over all their heads at once
    pre_norms: bool = True
    qk_norm_whole: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    query_scale: float = 1.0
    local_rope: rope.Rope | None = None
    sliding: tuple[bool, ...] = ()  # per layer: on local_rope (empty: none)
    # per layer: whether RoPE turns its q and k (SmolLM3's every 4th layer has no positions:
    # False); empty: every layer's do
    rotary: tuple[bool, ...] = ()

    def context_length(self) -> int:
        """The longest sequence the native engine runs: max_position_embeddings, or less where
        `position_limit` bounds it (every attention path masks a sliding window)."""
        limit = self.position_limit()
        return self.max_positions if limit is None else min(self.max_positions, limit[0])

    def position_limit(self) -> tuple[int, str] | None:
        """(the positions the native engine runs this model to, why), None for no bound:
        longrope's short factors hold up to the original context (`rope`)."""
        if self.rope.limit:
            return self.rope.limit, "longrope's short factors up to its original context"
        return None

    def rotates(self, layer: int) -> bool:
        """Whether RoPE turns layer `layer`'s queries and keys."""
        return not self.rotary or self.rotary[layer]

    def window_of(self, layer: int) -> int:
        """The keys layer `layer` sees before a query: the window where it slides (every layer
        of Phi-3's, Gemma's `sliding` ones), 0 for all."""
        return self.window if not self.sliding or self.sliding[layer] else 0

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """From a Hugging Face config dict; an unsupported RoPE scaling raises ValueError."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kind = cfg.get("model_type")
        if kind in ("qwen2", "qwen3", "smollm3") and cfg.get("use_sliding_window"):
            raise ValueError(
                f"this {kind} config sets use_sliding_window: the native engine runs its full "
                "attention only; use --backend hf"
            )
        if cfg.get("mlp_bias"):
            raise ValueError(
                "this config sets mlp_bias: the native engine's MLP has no biases; use --backend hf"
            )
        # Phi-3, Mistral v0.1: every layer's query sees the window's last keys (Qwen's
        # sliding_window is read only under use_sliding_window, refused above)
        window = int(cfg.get("sliding_window") or 0) if kind in ("phi3", "mistral") else 0
        if kind == "gemma3_text":
            return _gemma3(cfg, heads, head_dim)
        if kind == "olmo2":
            llama = cls.from_hf({**cfg, "model_type": "llama"})
            return dataclasses.replace(
                llama, qk_norm=True, qk_norm_whole=True, sandwich_norms=True, pre_norms=False
            )
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rope=rope.from_hf(cfg, head_dim),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings") or 4096),
            qk_norm=kind == "qwen3",
            window=window,
            rotary=_rotary(cfg) if kind == "smollm3" else (),
        )

    @classmethod
    def read(cls, path: str | Path) -> LlamaConfig:
        """The config of a safetensors folder (config.json) or a .gguf file (its metadata),
        no weight read: what the engine cannot run is refused before anything loads."""
        path = Path(path)
        if path.suffix == ".gguf":
            from smcspec.models import gguf_loader

            return cls.from_hf(gguf_loader.config(path))
        return cls.from_hf(json.loads((path / "config.json").read_text()))


def _rotary(cfg: dict) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate (`no_rope_layers`: 1 where a layer uses RoPE, 0 where it
    sees no positions, by default every `no_rope_layer_interval`-th)."""
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(bool(f) for f in flags)


def _gemma3(cfg: dict, heads: int, head_dim: int) -> LlamaConfig:
    """Gemma 3's text model: its sliding layers see their window's last keys."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            raise ValueError(f"this Gemma config sets {name}: the native engine has no capping")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("this Gemma config attends both ways: the native engine is causal")
    activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma's activation {activation!r} is not one the native engine runs")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # older configs: every pattern-th layer global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set per layer type
        full = {**cfg, "rope_parameters": params["full_attention"], "rope_scaling": None}
        local = {"rope_parameters": params.get("sliding_attention") or {}}
    else:
        full, local = cfg, {"rope_theta": cfg.get("rope_local_base_freq") or 10000.0}
    hidden = int(cfg["hidden_size"])
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rope=rope.from_hf(full, head_dim),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_positions=int(cfg.get("max_position_embeddings") or 32768),
        qk_norm=True,
        window=int(cfg.get("sliding_window") or 0),
        embed_scale=hidden**0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        activation="gelu_tanh",
        query_scale=(head_dim / float(cfg.get("query_pre_attn_scalar") or head_dim)) ** 0.5,
        local_rope=rope.from_hf(local, head_dim),
        sliding=tuple(t != "full_attention" for t in types),
    )
