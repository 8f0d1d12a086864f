"""The shapes and settings of a native Llama-family model (`llama.LlamaModel`), read from a
Hugging Face config or a GGUF file's metadata."""

from __future__ import annotations

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
    window: int = 0  # Phi-3: sliding-window attention over this many keys (0: none)

    @property
    def context_length(self) -> int:
        """The longest sequence the native engine runs: max_position_embeddings, or less where
        `position_limit` bounds it."""
        limit = self.position_limit
        return self.max_positions if limit is None else min(self.max_positions, limit[0])

    @property
    def position_limit(self) -> tuple[int, str] | None:
        """(the positions the native engine runs this model to, why), None for no bound: up to
        a sliding window attention is full (a query sees every key), and longrope's short
        factors hold up to the original context (`rope`)."""
        bounds = []
        if self.window:
            bounds.append((self.window, "full attention up to its sliding window"))
        if self.rope.limit:
            bounds.append((self.rope.limit, "longrope's short factors up to its original context"))
        return min(bounds, default=None)

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """From a Hugging Face config dict; an unsupported RoPE scaling raises ValueError."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kind = cfg.get("model_type")
        if kind == "qwen3" and cfg.get("use_sliding_window"):
            raise ValueError(
                "this Qwen3 config sets use_sliding_window: the native engine runs full "
                "attention only; use --backend hf"
            )
        if cfg.get("mlp_bias"):
            raise ValueError(
                "this config sets mlp_bias: the native engine's MLP has no biases; use --backend hf"
            )
        # Phi-3: a query sees the window's last keys; sequences up to it are full attention
        window = int(cfg.get("sliding_window") or 0) if kind == "phi3" else 0
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
