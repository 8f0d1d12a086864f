"""A native Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral) over a paged KV cache.

RMSNorm, rotary position embeddings (with the scalings of `rope`), grouped-query attention,
SwiGLU, optional q/k/v bias (Qwen2). Q, K and V are one fused projection, gate and up another.
A forward takes a ragged batch: each sequence appends its own number of tokens at its own
position. The model runs on any device (`device`); attention over the paged cache is pluggable
(`attention`), the decoders' view of the model is `native.NativeCausalLM`, and CUDA graphs of
its fixed-shape steps are `graphs.GraphRunner`.

Reference: this module is tested against `transformers` on the same weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from smcspec.kv.cache import PagedKVCache
from smcspec.models import cpu_linear, fused, prefill, weight_cache
from smcspec.models.attention import ForwardBatch, GatherAttention, GatherPlan, for_feed
from smcspec.models.attention import choose as choose_attention
from smcspec.models.fused import rotate_reference as _rotate
from smcspec.models.layers import cache_kind
from smcspec.models.llama_config import LlamaConfig
from smcspec.models.llama_weights import (
    Layer,
    WeightBuilder,
    quantized_entries,
    random_weights,
    read_safetensors,
)
from smcspec.models.norms import Norms
from smcspec.models.rope_table import RopeTable
from smcspec.sampling import to_device

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "smollm3", "olmo2")
QUANTIZED = ("int8", "int4")  # CPU weight formats, each with its weight cache
# Feeds longer than this run as successive passes of at most this many tokens per sequence, so
# no pass builds scores [heads, T, L] over a whole long prompt: SDPA takes its math kernel
# (float32 scores) whenever the gather path gives it a mask (a pass over a cached prefix, a
# ragged batch): about 120 GB per tensor for a 7B model (28 heads) at T = L = 32k, 7 GB for a
# 2048-token pass over 32k keys. At 2048 rows a pass is still compute-bound (7B on an H200:
# ~40 ms of matmuls against the 3 ms weight read each extra pass repeats).
PREFILL_CHUNK = 2048
# positions kept below the sliding window (every layer sliding): a rollback may move the next
# query back by this many (sd's K + 1 after a verification); a longer one is refused
KEPT_BEHIND_WINDOW = 256


class LlamaModel:
    """Weights in `dtype`: "float32", "bfloat16", "int8" or "int4" (weights only: activations,
    norms, embeddings and the KV cache stay float32; see `layers.Int8Linear`,
    `cpu_linear.PackedLinear`), on `device`.

    Every tensor of a forward is made on the model's device: the host plans the batch (page
    tables, slots, positions: `plan`) and moves it in a few copies; `hidden` and `logits` then
    run on the device alone, which is what lets `graphs.GraphRunner` capture them.

    With int8 weights, position 0 is computed apart, its activations split into magnitude bands:
    the first token of a sequence (the attention sink) carries activations hundreds of times
    larger than the rest in a few channels, which int8 activations cannot resolve (measured on
    Qwen2.5-Coder-1.5B: KL 2.9 nats at position 0 against float32, 0.006 elsewhere). Its result
    depends on the token id alone, so it is computed once per id and memoized (`_sinks`).

    Off the CPU (`fused`), the layer's small steps are the one-launch ops of `fused`, the residual
    adds riding with the norms after them: 9 launches a layer, where plain torch makes ~34 of
    them in bf16 (`launches.count_ops`). The CPU keeps the plain torch code, whose numbers the
    ops' references reproduce.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        attention: str = "auto",
        quantized: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        if dtype in QUANTIZED and self.device.type != "cpu":
            raise ValueError(f"{dtype} weights run on the CPU only; use bfloat16 on CUDA")
        self.attention = choose_attention(attention, self.device)
        # the fused kernels rotate whole heads and run Llama's layer: a partial rotary factor
        # and Gemma's layer run the torch ops
        self.fused = (
            self.device.type != "cpu"
            and config.rope.dim == config.head_dim
            and not config.sandwich_norms
        )
        self._gather = GatherAttention()
        self.act_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        build = WeightBuilder(config, dtype, self.device, self.act_dtype, quantized)
        self.embed = build.tensor(weights["model.embed_tokens.weight"])
        self.norm = build.norm(weights["model.norm.weight"])
        # Gemma's sqrt(hidden), in the activations' type as Gemma rounds it
        self.embed_scale = torch.tensor(config.embed_scale, dtype=self.act_dtype)
        self.layers, self.lm_head = build.layers(weights)
        kernel = cpu_linear.KERNEL.get() if self._on_kernel() else None
        self.norms = Norms(kernel)  # on the kernel with the products, as the attention
        if kernel is not None and config.head_dim % 16 == 0:
            # products on smcspec's kernel: its attention too, rows independent of their pass
            self._gather = GatherAttention(kernel.attend)
            if isinstance(self.attention, GatherAttention):
                self.attention = self._gather
        self.context_length = config.context_length()
        limit = config.position_limit()
        self.rope = RopeTable(config.rope, self.act_dtype, self.device, limit)
        local = config.local_rope  # Gemma's sliding layers' own
        self.local_rope = None if local is None else RopeTable(local, self.act_dtype, self.device)
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _on_kernel(self) -> bool:
        """Whether the layers' products run on smcspec's CPU kernel (int8/int4 where it is
        built; a matrix whose outputs are no multiple of 16 falls back alone)."""
        return any(isinstance(layer.qkv, cpu_linear.PackedLinear) for layer in self.layers)

    def quantized_entries(self) -> list[weight_cache.Entry]:
        """Every linear as the weight cache stores it, made when written."""
        return quantized_entries(self.lm_head, self.layers)

    @classmethod
    def from_folder(
        cls, folder: str | Path, dtype: str = "float32", device: str = "cpu", **kw
    ) -> LlamaModel:
        """Load a Hugging Face safetensors folder (config.json + *.safetensors)."""
        folder = Path(folder)
        config = LlamaConfig.read(folder)
        if dtype in QUANTIZED:
            lazy = weight_cache.LazyWeights(weight_cache.source_files(folder))
            return cls._quantized(folder, config, lazy, dtype, device, **kw)
        return cls(config, read_safetensors(folder), dtype, device, **kw)

    @classmethod
    def from_gguf(
        cls, path: str | Path, dtype: str = "float32", device: str = "cpu", **kw
    ) -> LlamaModel:
        """Load and de-quantize a GGUF file (`gguf_loader.ARCHITECTURES`); int8 and int4
        weights are quantized once and kept in a weight cache beside the file, as a folder's."""
        from smcspec.models import gguf_loader

        path = Path(path)
        config = LlamaConfig.read(path)
        weights = gguf_loader.weights(path, torch.float32)  # each de-quantized when read
        if dtype in QUANTIZED:
            return cls._quantized(path, config, weights, dtype, device, **kw)
        return cls(config, weights, dtype, device, **kw)

    @classmethod
    def _quantized(
        cls, spec: Path, config: LlamaConfig, weights, dtype: str, device: str, **kw
    ) -> LlamaModel:
        """The model with its linears from `spec`'s weight cache, or quantized from `weights`
        (read lazily: a cached linear's float weights are never read) and then cached."""
        kind = cache_kind(dtype)
        cached = weight_cache.load(spec, kind=kind)
        model = cls(config, weights, dtype, device, quantized=cached, **kw)
        if cached is None:
            weight_cache.save(spec, model.quantized_entries(), kind=kind)
            weight_cache.give_back_freed()
        return model

    @classmethod
    def random(
        cls, config: LlamaConfig, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        **kw,
    ) -> LlamaModel:  # fmt: skip
        """Random weights of `config`'s shapes, made on `device` (N(0, 0.02) as transformers
        initialises them, norms 1): speed per round does not depend on the weights."""
        return cls(config, random_weights(config, device, seed), dtype, device, **kw)

    def new_kv(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        c = self.config
        return PagedKVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, page_size, num_pages, self.act_dtype,
            self.device,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(
        self, kv: PagedKVCache, seqs: list[int], tokens: list[torch.Tensor], num_logits: int
    ) -> torch.Tensor:
        """Append tokens[b] (1-D, any length) to sequence seqs[b]; return logits of the last
        `num_logits` new positions of every sequence: [B, num_logits, V]. Ragged batch: a sequence
        given fewer than `num_logits` tokens gets zero logits in the leading rows it lacks."""
        rows = self.forward_ragged(kv, seqs, tokens, [num_logits] * len(seqs))
        return prefill.stack_padded(rows, num_logits)

    @torch.inference_mode()
    def forward_ragged(
        self, kv: PagedKVCache, seqs: list[int], tokens: list[torch.Tensor], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """As `forward`, with a logits count per sequence: the float32 logits of the last
        min(len(tokens[b]), num_logits[b]) new positions of sequence b, list of [n_b, V]. One
        pass over the weights serves every sequence (continuous batching mixes requests); a
        feed longer than `PREFILL_CHUNK` takes several (`prefill.chunks`)."""
        tokens = list(tokens)
        sinks: dict[int, torch.Tensor] = {}
        if self.dtype == "int8":
            for b, seq in enumerate(seqs):
                if kv.lengths[seq] == 0 and tokens[b].numel() > 0:
                    sinks[b] = self._write_sink(kv, seq, int(tokens[b][0]))
                    tokens[b] = tokens[b][1:]
        counts = [int(t.numel()) for t in tokens]
        pieces: list[list[torch.Tensor]] = [[] for _ in seqs]
        for chunk in prefill.chunks(counts, num_logits, PREFILL_CHUNK):
            feeds = [tokens[b][start:end] for b, start, end, _ in chunk]
            wants = [want for *_, want in chunk]
            logits = self._pass(kv, [seqs[b] for b, *_ in chunk], feeds, wants)
            for (b, *_), row in zip(chunk, logits, strict=True):
                pieces[b].append(row)
        rows = []
        for b in range(len(seqs)):
            row = prefill.joined(pieces[b], self.config.vocab_size, self.device)  # [n_b, V]
            if row.shape[0] < num_logits[b] and b in sinks:
                row = torch.cat([sinks[b][None], row])
            rows.append(row)
        return rows

    def _pass(
        self, kv: PagedKVCache, seqs: list[int], tokens: list[torch.Tensor], wants: list[int]
    ) -> list[torch.Tensor]:
        """One pass over the weights: append tokens[b] (non-empty) to seqs[b]; the float32
        logits of the last wants[b] of them, list of [wants[b], V]."""
        counts = [int(t.numel()) for t in tokens]
        batch = self.plan(kv, seqs, counts)
        # Rows may come from the host (a prompt) and the device (sampled drafts) at once, when
        # the scheduler batches several requests.
        flat = torch.cat([to_device(t, self.device) for t in tokens])  # [total]
        x = self.hidden(flat, batch, kv)  # [total, H]
        keep = prefill.last_rows(counts, wants)
        logits = self.logits(x[to_device(keep, self.device)]).float()  # [rows kept, V]
        return list(logits.split(wants))

    def plan(self, kv: PagedKVCache, seqs: list[int], counts: list[int]) -> ForwardBatch:
        """Reserve counts[b] new positions of each sequence (host page tables) and build what the
        layers need, on the device: slots, positions and the attention's own indices."""
        starts = [kv.lengths[s] for s in seqs]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        self.rope.ensure(max(ends))  # first: it may refuse, and nothing is reserved yet
        if self.local_rope is not None:
            self.local_rope.ensure(max(ends))
        self.forget_old_keys(kv, seqs, starts)
        slots = torch.cat([kv.reserve(s, n) for s, n in zip(seqs, counts, strict=True)])
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        dev = self.device
        attention = for_feed(self.attention, self._gather, starts, counts)
        batch = ForwardBatch(to_device(slots, dev), to_device(positions, dev), attention=attention)
        if attention.paged:
            width = max(len(kv.tables[s]) for s in seqs)
            batch.block_tables = to_device(kv.block_tables(seqs, width), dev)
            rows = torch.arange(len(seqs), dtype=torch.int32)
            batch.seq_index = to_device(rows.repeat_interleave(torch.tensor(counts)), dev)
            starts_flat = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
            batch.query_starts = to_device(starts_flat, dev)  # [B + 1]
            batch.max_query_len = max(counts)
        else:
            p = GatherAttention.plan(kv, seqs, starts, counts)
            batch.gather = GatherPlan(
                to_device(p.key_slots, dev), _opt(p.query_index, dev), _opt(p.query_rows, dev),
                _opt(p.mask, dev), p.tmax, _opt(p.row_seq, dev),
            )  # fmt: skip
        return batch

    def hidden(self, tokens: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """The layers over flat new tokens [total] (on the device): hidden states [total, H]
        before the final norm. No host sync, no host tensor."""
        if self.fused:
            return self._hidden_fused(tokens, batch, kv)
        c = self.config
        eps = c.rms_eps
        x = self._embedded(tokens)  # [total, H]
        turns = self.rope(batch.positions)  # (cos, sin) [total, D] each
        local = turns if self.local_rope is None else self.local_rope(batch.positions)
        still = _no_turn(turns) if c.rotary else turns
        norm = self.norms
        for i, layer in enumerate(self.layers):
            cos, sin = local if c.sliding and c.sliding[i] else turns
            if not c.rotates(i):
                cos, sin = still
            h = norm(x, layer.input_norm, eps)
            x = x + norm(
                self._attention(layer, i, h, cos, sin, kv, batch), layer.attn_out_norm, eps
            )
            h = norm(x, layer.post_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + norm(layer.down(_act(gate, c.activation) * up), layer.mlp_out_norm, eps)
        return x

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [total, H], times Gemma's scale where the model has one."""
        x = F.embedding(tokens, self.embed)
        if self.config.embed_scale != 1.0:
            x = x * self.embed_scale.to(x.device)
        return x

    def _hidden_fused(
        self, tokens: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        """`hidden` in one-launch ops: each residual add is fused with the norm that reads the
        sum (the attention's with the post-attention norm, the MLP's with the next layer's
        input norm); the last layer's MLP add stays apart, as `hidden` returns x before the
        final norm (the callers keep only some rows for the logits)."""
        c = self.config
        eps = c.rms_eps
        x = F.embedding(tokens, self.embed)  # [total, H]
        turns = self.rope(batch.positions)  # (cos, sin) [total, D]
        still = _no_turn(turns) if c.rotary else turns
        h = fused.rms_norm(x, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin = turns if c.rotates(i) else still
            attended = self._attention(layer, i, h, cos, sin, kv, batch)
            h, x = fused.add_rms_norm(attended, x, layer.post_norm, eps)
            mlp = layer.down(fused.silu_mul(layer.gate_up(h)))  # [total, H]
            if i == last:
                x = x + mlp
            else:
                h, x = fused.add_rms_norm(mlp, x, self.layers[i + 1].input_norm, eps)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits [n, V] (in the weights' float type) of hidden states x [n, H]."""
        norm = fused.rms_norm if self.fused else self.norms.rms
        return self.lm_head(norm(x, self.norm, self.config.rms_eps))

    def forget_old_keys(self, kv: PagedKVCache, seqs: list[int], starts: list[int]) -> None:
        """Where every layer slides over `window` keys, free the pages below the window of the
        first query of this pass less KEPT_BEHIND_WINDOW positions (a rollback, as sd's and
        msd's after a verification, moves the next query back by at most that); refuse a
        pass that would need a freed key. Other models keep every key."""
        window = self.config.window
        if not window or any(not s for s in self.config.sliding):
            return
        for seq, start in zip(seqs, starts, strict=True):
            kv.check_kept(seq, start - window + 1)
            kv.forget_before(seq, start - window + 1 - KEPT_BEHIND_WINDOW)

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
        x = self._embedded(torch.tensor([token], device=self.embed.device))  # [1, H]
        self.rope.ensure(1)
        cos, sin = self.rope(torch.zeros(1, dtype=torch.long))  # identity, times yarn's factor
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv.banded(self.norms(x, layer.input_norm, c.rms_eps))
            qkv = self.norms.heads(layer, qkv.view(1, nh + 2 * nkv, d), nh, nkv, c.rms_eps)
            _, k, v = qkv.split([nh, nkv, nkv], dim=1)  # k, v [1, nkv, d]
            keys.append(_rope(k, cos, sin)[0] if c.rotates(i) else k[0])
            values.append(v.view(nkv, d))
            attended = v.view(nkv, 1, d).expand(nkv, nh // nkv, d).reshape(1, nh * d)
            x = x + self.norms(layer.o.banded(attended), layer.attn_out_norm, c.rms_eps)
            h = self.norms(x, layer.post_norm, c.rms_eps)
            gate, up = layer.gate_up.banded(h).chunk(2, dim=-1)
            mlp = layer.down.banded(_act(gate, c.activation) * up)
            x = x + self.norms(mlp, layer.mlp_out_norm, c.rms_eps)
        logits = self.lm_head.banded(self.norms.rms(x, self.norm, c.rms_eps))[0].float()
        return torch.stack(keys), torch.stack(values), logits

    def _attention(
        self,
        layer: Layer,
        index: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKVCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        c = self.config
        d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        qkv = self.norms.heads(layer, layer.qkv(h).view(-1, nh + 2 * nkv, d), nh, nkv, c.rms_eps)
        if self.fused:
            q = fused.rope_write(qkv, cos, sin, kv.k[index], kv.v[index], batch.slots, nh, nkv)
        else:
            qk = _rope(qkv[:, : nh + nkv], cos, sin)  # q and k heads rotated together
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
            kv.write(index, batch.slots, k, v)
        attention = batch.attention or self.attention
        out = attention(q, kv, index, batch, c.window_of(index))  # [total, nh, d]
        return layer.o(out.reshape(-1, nh * d))


def _no_turn(turns: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of no rotation, shaped as `turns`: a layer without RoPE (SmolLM3's) runs the
    same ops on them, and x * 1 + r * 0 is x to the bit."""
    cos, sin = turns
    return torch.ones_like(cos), torch.zeros_like(sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [total, heads, d] over the first cos.shape[-1] of each head's dimensions (all
    of them but for a partial rotary factor, Phi-4-mini's 0.75); the rest pass unrotated."""
    turned = cos.shape[-1]
    if turned == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat([_rotate(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)


def _act(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP's activation of its gate: SiLU (Llama's SwiGLU) or GeLU, tanh form (Gemma's)."""
    return F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)


def _opt(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else to_device(t, device)
