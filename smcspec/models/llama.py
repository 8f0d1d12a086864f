"""A native Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral) over a paged KV cache.

RMSNorm, rotary position embeddings (with the scalings of `rope`), grouped-query attention,
SwiGLU, optional q/k/v bias (Qwen2). Q, K and V are one fused projection, gate and up another.
A forward takes a ragged batch: each sequence appends its own number of tokens at its own
position.

Reference: this module is tested against `transformers` on the same weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from smcspec.kv.cache import PagedKVCache
from smcspec.models import rope
from smcspec.models.layers import DenseLinear, Int8Linear, make_linear

Linear = DenseLinear | Int8Linear

SUPPORTED = ("llama", "qwen2", "mistral")


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

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """From a Hugging Face config dict; an unsupported RoPE scaling raises ValueError."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
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
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings") or 4096),
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


@dataclass
class Layer:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> (heads + 2 kv_heads) * D, with Qwen2's bias
    o: Linear  # heads * D -> H
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H


class LlamaModel:
    """Weights in `dtype`: "float32", "bfloat16" or "int8" (weights only: activations, norms,
    embeddings and the KV cache stay float32; see `layers.Int8Linear`).

    With int8 weights, position 0 is computed apart, its activations split into magnitude bands:
    the first token of a sequence (the attention sink) carries activations hundreds of times
    larger than the rest in a few channels, which int8 activations cannot resolve (measured on
    Qwen2.5-Coder-1.5B: KL 2.9 nats at position 0 against float32, 0.006 elsewhere). Its result
    depends on the token id alone, so it is computed once per id and memoized (`_sinks`).
    """

    def __init__(
        self, config: LlamaConfig, weights: dict[str, torch.Tensor], dtype: str = "float32"
    ) -> None:
        self.config = config
        self.dtype = dtype
        w = weights
        self.act_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.embed = w["model.embed_tokens.weight"].to(self.act_dtype)
        self.norm = w["model.norm.weight"].to(self.act_dtype)
        head = w["model.embed_tokens.weight"] if config.tie_embeddings else w.pop("lm_head.weight")
        self.lm_head = make_linear(head, None, dtype)
        self.layers = []
        for i in range(config.num_layers):
            self.layers.append(self._layer(w, f"model.layers.{i}."))
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _layer(self, w: dict[str, torch.Tensor], p: str) -> Layer:
        """Build layer `p`, taking its weights out of `w` so that float copies are freed as the
        quantized ones are made."""
        a = p + "self_attn."
        bias = None
        if self.config.qkv_bias:
            bias = torch.cat(
                [w.pop(a + "q_proj.bias"), w.pop(a + "k_proj.bias"), w.pop(a + "v_proj.bias")]
            )
        qkv = torch.cat(
            [w.pop(a + "q_proj.weight"), w.pop(a + "k_proj.weight"), w.pop(a + "v_proj.weight")]
        )
        gate_up = torch.cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
        dt = self.dtype
        return Layer(
            input_norm=w.pop(p + "input_layernorm.weight").to(self.act_dtype),
            qkv=make_linear(qkv, bias, dt),
            o=make_linear(w.pop(a + "o_proj.weight"), None, dt),
            post_norm=w.pop(p + "post_attention_layernorm.weight").to(self.act_dtype),
            gate_up=make_linear(gate_up, None, dt),
            down=make_linear(w.pop(p + "mlp.down_proj.weight"), None, dt),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: str = "float32") -> LlamaModel:
        """Load a Hugging Face safetensors folder (config.json + *.safetensors)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = LlamaConfig.read(folder)
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        return cls(config, weights, dtype)

    @classmethod
    def from_gguf(cls, path: str | Path, dtype: str = "float32") -> LlamaModel:
        """Load and de-quantize a GGUF file (llama, qwen2, mistral)."""
        from smcspec.models import gguf_loader

        config = LlamaConfig.read(path)
        return cls(config, gguf_loader.weights(path, torch.float32), dtype)

    def new_kv(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        c = self.config
        return PagedKVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, page_size, num_pages, self.act_dtype
        )

    @torch.inference_mode()
    def forward(
        self, kv: PagedKVCache, seqs: list[int], tokens: list[torch.Tensor], num_logits: int
    ) -> torch.Tensor:
        """Append tokens[b] (1-D, any length) to sequence seqs[b]; return logits of the last
        `num_logits` new positions of every sequence: [B, num_logits, V]. Ragged batch: a sequence
        given fewer than `num_logits` tokens gets zero logits in the leading rows it lacks."""
        rows = self.forward_ragged(kv, seqs, tokens, [num_logits] * len(seqs))
        return _stack_padded(rows, num_logits)

    @torch.inference_mode()
    def forward_ragged(
        self, kv: PagedKVCache, seqs: list[int], tokens: list[torch.Tensor], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """As `forward`, with a logits count per sequence: the logits of the last
        min(len(tokens[b]), num_logits[b]) new positions of sequence b, list of [n_b, V]. One
        pass over the weights serves every sequence (continuous batching mixes requests)."""
        tokens = list(tokens)
        sinks: dict[int, torch.Tensor] = {}
        if self.dtype == "int8":
            for b, seq in enumerate(seqs):
                if kv.lengths[seq] == 0 and tokens[b].numel() > 0:
                    sinks[b] = self._write_sink(kv, seq, int(tokens[b][0]))
                    tokens[b] = tokens[b][1:]
        live = [b for b in range(len(seqs)) if tokens[b].numel() > 0]
        hidden = self._hidden(
            [seqs[b] for b in live], [tokens[b] for b in live], kv, [num_logits[b] for b in live]
        )
        by_row = {}
        if hidden:
            logits = self.lm_head(torch.cat(hidden)).float()  # [rows kept, V]
            by_row = dict(zip(live, logits.split([h.shape[0] for h in hidden]), strict=True))
        rows = []
        for b in range(len(seqs)):
            row = by_row.get(b, torch.zeros(0, self.config.vocab_size))  # [n_b, V]
            if row.shape[0] < num_logits[b] and b in sinks:
                row = torch.cat([sinks[b][None], row])
            rows.append(row)
        return rows

    def _hidden(
        self, seqs: list[int], tokens: list[torch.Tensor], kv: PagedKVCache, num_logits: list[int]
    ) -> list[torch.Tensor]:
        """Run the layers over a ragged batch; the final-normed hidden states of the last
        min(len(tokens[b]), num_logits[b]) positions of each sequence: list of [n_b, H]."""
        if not seqs:
            return []
        c = self.config
        counts = [int(t.numel()) for t in tokens]
        starts = [kv.lengths[s] for s in seqs]
        slots = torch.cat([kv.reserve(s, n) for s, n in zip(seqs, counts, strict=True)])
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        x = F.embedding(torch.cat(tokens), self.embed)  # [total, H]
        cos, sin = self._rope(positions)  # [total, D]
        batch = _AttentionBatch.build(kv, seqs, starts, counts)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(
                layer, i, _rms(x, layer.input_norm, c.rms_eps), cos, sin, slots, kv, batch
            )
            h = _rms(x, layer.post_norm, c.rms_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        ends = torch.tensor(counts).cumsum(0).tolist()
        keep = [
            torch.arange(e - min(n, m), e) for e, n, m in zip(ends, counts, num_logits, strict=True)
        ]
        x = _rms(x[torch.cat(keep)], self.norm, c.rms_eps)
        return list(x.split([k.numel() for k in keep]))

    def _write_sink(self, kv: PagedKVCache, seq: int, token: int) -> torch.Tensor:
        """Store position 0 of `seq` (token id `token`); return its next-token logits [V]."""
        if token not in self._sinks:
            self._sinks[token] = self._sink(token)
        keys, values, logits = self._sinks[token]
        slot = kv.reserve(seq, 1)
        for i in range(self.config.num_layers):
            kv.write(i, slot, keys[i][None], values[i][None])
        return logits

    def _sink(self, token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [layers, kv_heads, D] and next-token logits [V] of `token` at position 0,
        every linear in its banded form (int8 weights; activations split by magnitude so the
        sink's outliers keep their precision, see `Int8Linear.banded`). At position 0 attention
        sees only the token itself, so its output is its own value, and the query is not needed.
        """
        c = self.config
        d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        x = self.embed[token][None]  # [1, H]
        cos, sin = self._rope(torch.zeros(1, dtype=torch.long))  # identity, times yarn's factor
        keys, values = [], []
        for layer in self.layers:
            qkv = layer.qkv.banded(_rms(x, layer.input_norm, c.rms_eps))
            _, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            keys.append(_rotate(k.view(1, nkv, d), cos, sin)[0])
            values.append(v.view(nkv, d))
            attended = v.view(nkv, 1, d).expand(nkv, nh // nkv, d).reshape(1, nh * d)
            x = x + layer.o.banded(attended)
            h = _rms(x, layer.post_norm, c.rms_eps)
            gate, up = layer.gate_up.banded(h).chunk(2, dim=-1)
            x = x + layer.down.banded(F.silu(gate) * up)
        logits = self.lm_head.banded(_rms(x, self.norm, c.rms_eps))[0].float()
        return torch.stack(keys), torch.stack(values), logits

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [total, D] of positions [total], both scaled by the rope's attention factor."""
        angles = rope.angles(self.config.rope, positions)  # [total, D/2]
        angles = torch.cat([angles, angles], dim=-1)
        scale = self.config.rope.attention_factor
        return (angles.cos() * scale).to(self.act_dtype), (angles.sin() * scale).to(self.act_dtype)

    def _attention(
        self,
        layer: Layer,
        index: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        kv: PagedKVCache,
        batch: _AttentionBatch,
    ) -> torch.Tensor:
        c = self.config
        d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        qkv = layer.qkv(h).view(-1, nh + 2 * nkv, d)  # [total, nh + 2 nkv, d]
        qk = _rotate(qkv[:, : nh + nkv], cos, sin)  # q and k heads rotated together
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        kv.write(index, slots, k, v)
        out = batch.attend(kv, index, q)  # [total, nh, d]
        return layer.o(out.reshape(-1, nh * d))


@dataclass
class _AttentionBatch:
    """Index tensors shared by every layer of one forward: the padded key slots of each sequence,
    the padded query rows, and the causal mask over them. When every sequence appends the same
    number of tokens (what the decoders do) the flat rows already form a [B, T] grid and the
    query gather is skipped; when moreover T = 1 and all lengths agree, no mask is needed."""

    key_slots: torch.Tensor  # [B, Lmax]
    query_index: torch.Tensor | None  # [B, Tmax] rows of the flat batch (padding -> row 0)
    query_valid: torch.Tensor | None  # [B, Tmax]
    mask: torch.Tensor | None  # [B, 1, Tmax, Lmax] True = may attend
    tmax: int

    @classmethod
    def build(cls, kv: PagedKVCache, seqs: list[int], starts: list[int], counts: list[int]):
        lengths = [s + n for s, n in zip(starts, counts, strict=True)]
        lmax, tmax, b = max(lengths), max(counts), len(seqs)
        key_slots = torch.zeros(b, lmax, dtype=torch.long)
        for i, seq in enumerate(seqs):
            key_slots[i, : lengths[i]] = kv.slots(seq)
        query_index = query_valid = mask = None
        if min(counts) != tmax:
            query_index = torch.zeros(b, tmax, dtype=torch.long)
            query_valid = torch.zeros(b, tmax, dtype=torch.bool)
            offset = 0
            for i, n in enumerate(counts):
                query_index[i, :n] = torch.arange(offset, offset + n)
                query_valid[i, :n] = True
                offset += n
        if tmax > 1 or min(lengths) != lmax:
            q_pos = torch.tensor(starts)[:, None] + torch.arange(tmax)[None, :]  # [B, Tmax]
            k_pos = torch.arange(lmax)[None, None, :]
            # Causal; a valid query never sees past its own sequence's end, and padded query
            # rows are dropped after attention.
            mask = (k_pos <= q_pos[:, :, None])[:, None]
        return cls(key_slots, query_index, query_valid, mask, tmax)

    def attend(self, kv: PagedKVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Scaled-dot-product attention of flat queries q [total, nh, d] over the paged keys
        (grouped-query: nh is a multiple of the cache's kv heads)."""
        flat_k = kv.k[layer].view(-1, *kv.k.shape[-2:])
        flat_v = kv.v[layer].view(-1, *kv.v.shape[-2:])
        keys = flat_k[self.key_slots].transpose(1, 2)  # [B, nkv, Lmax, d]
        values = flat_v[self.key_slots].transpose(1, 2)
        b = self.key_slots.shape[0]
        if self.query_index is None:
            queries = q.view(b, self.tmax, *q.shape[1:]).transpose(1, 2)  # [B, nh, T, d]
        else:
            queries = q[self.query_index].transpose(1, 2)  # [B, nh, Tmax, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=self.mask, enable_gqa=True
        ).transpose(1, 2)  # [B, Tmax, nh, d]
        if self.query_valid is None:
            return out.reshape(-1, *q.shape[1:])
        return out[self.query_valid]  # [total, nh, d] in flat order


def _stack_padded(rows: list[torch.Tensor], num_logits: int) -> torch.Tensor:
    """Rows [n_b, V] with n_b <= num_logits as [B, num_logits, V], zeros in the missing
    leading positions."""
    return torch.stack([F.pad(r, (0, 0, num_logits - r.shape[0], 0)) for r in rows])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [total, heads, d] with cos, sin [total, d] (halves convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class NativeCache:
    """The decoders' `KVCache` view of a paged cache: one paged sequence per row."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.rows: list[int] = [kv.new_sequence()]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return self.kv.lengths[self.rows[0]] if self.rows else 0

    def select(self, rows: torch.Tensor) -> None:
        """Resampling by page tables: new row i shares old row rows[i]'s pages (no KV copy)."""
        new = [self.kv.fork(self.rows[int(r)]) for r in rows]
        for seq in self.rows:
            self.kv.release(seq)
        self.rows = new

    def crop(self, length: int) -> None:
        for seq in self.rows:
            self.kv.truncate(seq, length)

    def release(self) -> None:
        for seq in self.rows:
            self.kv.release(seq)
        self.rows = []


class NativeCausalLM:
    """`CausalLM` over `LlamaModel`: each new cache draws pages from one shared pool, and
    `forward_many` runs the calls of several caches (several requests) as one batch."""

    def __init__(
        self, model: LlamaModel, eos_token_ids: set[int], num_pages: int = 4096, page_size: int = 16
    ) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = model.config.max_positions
        self.kv = model.new_kv(num_pages, page_size)
        self.pages = self.kv.allocator

    def new_cache(self) -> NativeCache:
        return NativeCache(self.kv)

    def forward(self, tokens: torch.Tensor, cache: NativeCache, num_logits: int) -> torch.Tensor:
        return self.forward_many([(tokens, cache, num_logits)])[0]

    def forward_many(
        self, calls: list[tuple[torch.Tensor, NativeCache, int]]
    ) -> list[torch.Tensor]:
        """`forward` for each (tokens [B_c, T_c], cache, num_logits_c), in one pass over the
        weights; returns each call's logits [B_c, num_logits_c, V]."""
        seqs: list[int] = []
        rows: list[torch.Tensor] = []
        wants: list[int] = []
        for tokens, cache, num_logits in calls:
            if cache.length == 0 and tokens.shape[0] != cache.batch_size:
                cache.select(torch.zeros(tokens.shape[0], dtype=torch.long))
            assert tokens.shape[0] == cache.batch_size, "one row of tokens per cache row"
            seqs += cache.rows
            rows += list(tokens)
            wants += [num_logits] * tokens.shape[0]
        logits = self.model.forward_ragged(self.kv, seqs, rows, wants)
        out, start = [], 0
        for tokens, _, num_logits in calls:
            out.append(_stack_padded(logits[start : start + tokens.shape[0]], num_logits))
            start += tokens.shape[0]
        return out
