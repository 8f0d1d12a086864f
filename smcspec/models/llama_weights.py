"""The weights of a native Llama (`llama.LlamaModel`): a Hugging Face-named state dict made into
one `Layer` of fused linears per decoder layer and the LM head, in the model's dtype on its
device; what the weight cache (`weight_cache`) stores of them; and random weights of a config's
shapes.

Q, K and V become one linear, gate and up another, so a layer runs two matmuls where the state
dict names five. With quantized weights, a linear the cache holds is taken from it and the
float one is never quantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from smcspec.models import cpu_linear, weight_cache
from smcspec.models.layers import AtenInt4Linear, Int8Linear, Linear, make_linear
from smcspec.models.llama_config import LlamaConfig


@dataclass
class Layer:
    input_norm: torch.Tensor | None  # [H] (None: OLMo 2's layer has no norm before attention)
    qkv: Linear  # H -> (heads + 2 kv_heads) * D, with Qwen2's bias
    o: Linear  # heads * D -> H
    post_norm: torch.Tensor | None  # [H], before the MLP (None: OLMo 2)
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H
    # [D], Qwen3's per-head norm of q (OLMo 2's: [heads * D], over all heads); None: none
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None  # [D] or [kv_heads * D], of k
    attn_out_norm: torch.Tensor | None = None  # [H], Gemma's norm of the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [H], of the MLP's


class WeightBuilder:
    """Makes the model's tensors (in `act_dtype`) and linears (in `dtype`) on `device`, taking
    each linear from `quantized` (cached quantized linears, popped as they are used) when it holds
    it."""

    def __init__(
        self,
        config: LlamaConfig,
        dtype: str,
        device: torch.device,
        act_dtype: torch.dtype,
        quantized: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.config, self.dtype, self.device, self.act_dtype = config, dtype, device, act_dtype
        self.quantized = quantized

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.act_dtype)

    def norm(self, t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """A norm's weight as the model multiplies by it: Gemma stores w for 1 + w
        (`norm_offset`), in float32 as Gemma adds it; `scale` folds a constant in."""
        return self.tensor((t.float() + self.config.norm_offset) * scale)

    def layers(self, w: Mapping[str, torch.Tensor]) -> tuple[list[Layer], Linear]:
        """Every layer and the LM head. Packing int8 weights (fbgemm) and quantizing them take
        most of a load: they are built on as many threads as torch computes on (the ops release
        the GIL), the head first (the vocabulary's matrix packs slowest: 2 s of 10 s for 1.5B).
        """
        c = self.config
        head = "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            lm_head = pool.submit(self.linear, w, "lm_head", [head], keep=c.tie_embeddings)
            names = [f"model.layers.{i}." for i in range(c.num_layers)]
            cold = self.quantized is None and self.dtype in ("int8", "int4")
            bar = tqdm(  # shown on a terminal only
                total=len(names),
                desc=f"quantizing to {self.dtype}",
                disable=not cold or None,
            )
            with bar:
                layers = list(bar_map(pool, lambda p: self.layer(w, p), names, bar))
            return layers, lm_head.result()

    def layer(self, w: Mapping[str, torch.Tensor], p: str) -> Layer:
        """Build layer `p`, taking its weights out of `w` so that float copies are freed as the
        quantized ones are made."""
        a = p + "self_attn."
        qkv = [a + f"{x}_proj.weight" for x in "qkv"]
        qkv_bias = [a + f"{x}_proj.bias" for x in "qkv"] if self.config.qkv_bias else []
        gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        if a + "qkv_proj.weight" in w:  # Phi-3 stores them fused, in the same order
            qkv = [a + "qkv_proj.weight"]
        if p + "mlp.gate_up_proj.weight" in w:
            gate_up = [p + "mlp.gate_up_proj.weight"]
        c = self.config
        norms = {}
        if c.qk_norm:  # q's folds in Gemma's query scale (scores are linear in q)
            scales = {"q": c.query_scale, "k": 1.0}
            norms = {f"{x}_norm": self.norm(w.pop(a + f"{x}_norm.weight"), scales[x]) for x in "qk"}
        before_mlp = "post_attention_layernorm"
        if c.sandwich_norms:  # Gemma, OLMo 2: the post-attention norm is on its output
            before_mlp = "pre_feedforward_layernorm"
            norms["attn_out_norm"] = self.norm(w.pop(p + "post_attention_layernorm.weight"))
            norms["mlp_out_norm"] = self.norm(w.pop(p + "post_feedforward_layernorm.weight"))
        pre = c.pre_norms  # OLMo 2 has none before the attention and the MLP
        return Layer(
            input_norm=self.norm(w.pop(p + "input_layernorm.weight")) if pre else None,
            qkv=self.linear(w, a + "qkv", qkv, qkv_bias),
            o=self.linear(w, a + "o", [a + "o_proj.weight"]),
            post_norm=self.norm(w.pop(p + f"{before_mlp}.weight")) if pre else None,
            gate_up=self.linear(w, p + "mlp.gate_up", gate_up),
            down=self.linear(w, p + "mlp.down", [p + "mlp.down_proj.weight"]),
            **norms,
        )

    def linear(
        self,
        w: Mapping[str, torch.Tensor],
        key: str,
        weights: list[str],
        biases: list[str] | None = None,
        keep: bool = False,
    ) -> Linear:
        """The linear layer `key` over the concatenated `weights` (and `biases`): from the weight
        cache when it holds it, else made from the float weights (taken out of `w` unless
        `keep`)."""
        cached = self.quantized
        made = None if cached is None else _from_cache(cached, key)
        if made is not None:
            return made
        take = w.__getitem__ if keep else w.pop
        parts = [take(n) for n in weights]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        bias = torch.cat([w.pop(n) for n in biases]) if biases else None
        return made_by_rows(weight, bias, self.dtype, self.device)


# Rows of a matrix quantized at once for smcspec's kernel: the float temporaries of quantizing
# (`cpu_linear.quantize`: W - lo, its rounding, the packing) stay a block's size; whole, they
# were 1.4 GB beside the 0.9 GB output matrix of a 1.5B model (151936 x 1536).
ROWS_AT_ONCE = 8192


def made_by_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: str, device: torch.device
) -> Linear:
    """`make_linear(weight, bias, dtype, device)`, a block of ROWS_AT_ONCE rows at a time where
    it is smcspec's kernel: its rows quantize apart (groups run along the inputs, blocks of
    `LANES` outputs), so the blocks' tensors joined are the whole matrix's, bit for bit."""
    rows = weight.shape[0]
    if rows <= ROWS_AT_ONCE or rows % cpu_linear.LANES:
        return make_linear(weight, bias, dtype, device)
    first = make_linear(weight[:ROWS_AT_ONCE], None, dtype, device)
    if not isinstance(first, cpu_linear.PackedLinear):
        return make_linear(weight, bias, dtype, device)
    blocks = [first.quantized()]
    for start in range(ROWS_AT_ONCE, rows, ROWS_AT_ONCE):
        block = make_linear(weight[start : start + ROWS_AT_ONCE], None, dtype, device)
        blocks.append(block.quantized())
    packed = torch.cat([p for p, _ in blocks])  # [rows / LANES, ...] each
    scales = torch.cat([s for _, s in blocks])
    return cpu_linear.PackedLinear.from_quantized(packed, scales, bias, first.bits)


def _from_cache(cached: Mapping[str, torch.Tensor], key: str) -> Linear | None:
    """The linear `key` out of the weight cache (its tensors popped), in whichever of the cached
    formats it was stored, or None when the cache does not hold it."""
    if not any(f"{key}.{first}" in cached for first in ("q", "packed", "q4", "q8")):
        return None
    bias = cached.pop(f"{key}.bias") if f"{key}.bias" in cached else None
    if f"{key}.q" in cached:
        return Int8Linear.from_quantized(cached.pop(f"{key}.q"), cached.pop(f"{key}.scale"), bias)
    for bits in (4, 8):
        if f"{key}.q{bits}" in cached:
            packed, scales = cached.pop(f"{key}.q{bits}"), cached.pop(f"{key}.scales")
            return cpu_linear.PackedLinear.from_quantized(packed, scales, bias, bits)
    packed, sz = cached.pop(f"{key}.packed"), cached.pop(f"{key}.scales_zeros")
    group = _group_of(packed, sz)
    return AtenInt4Linear.from_quantized(packed, sz, bias, group, group * sz.shape[0])


def bar_map(pool: ThreadPoolExecutor, fn, items: list, bar) -> Iterator:
    """pool.map(fn, items), moving `bar` on as each result is taken, in order."""
    for result in pool.map(fn, items):
        bar.update(1)
        yield result


def _group_of(packed: torch.Tensor, scales_zeros: torch.Tensor) -> int:
    """An int4 linear's group size, from its tensors: the packed matrix holds two inputs a byte
    per output, the scales one row per group."""
    return packed.numel() * 2 // scales_zeros.shape[1] // scales_zeros.shape[0]


def quantized_entries(lm_head: Linear, layers: list[Layer]) -> list[weight_cache.Entry]:
    """Every linear as the weight cache stores it, made when written: int4 or int8 on smcspec's
    kernel (q4 or q8, scales, bias), int8 on fbgemm (q, scale, bias) or int4 on PyTorch's kernel
    (packed, scales_zeros, bias)."""
    named = [("lm_head", lm_head)]
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        named += [(p + "self_attn.qkv", layer.qkv), (p + "self_attn.o", layer.o)]
        named += [(p + "mlp.gate_up", layer.gate_up), (p + "mlp.down", layer.down)]
    entries: list[weight_cache.Entry] = []
    for key, linear in named:
        out, inp = linear.out_features, linear.in_features
        if isinstance(linear, cpu_linear.PackedLinear):
            packed, sl = linear.quantized()
            shapes = {
                f"q{linear.bits}": (torch.uint8, tuple(packed.shape)),
                "scales": (torch.float16, tuple(sl.shape)),
            }
        elif isinstance(linear, AtenInt4Linear):
            packed, sz = linear.quantized()
            shapes = {
                "packed": (torch.uint8, tuple(packed.shape)),
                "scales_zeros": (torch.float32, tuple(sz.shape)),
            }
        else:
            shapes = {"q": (torch.int8, (out, inp)), "scale": (torch.float32, (out,))}
        for i, (name, (dtype, shape)) in enumerate(shapes.items()):
            entries.append((f"{key}.{name}", dtype, shape, lambda x=linear, i=i: x.quantized()[i]))
        if linear.bias is not None:
            entries.append((f"{key}.bias", torch.float32, (out,), lambda x=linear: x.bias))
    return entries


def read_safetensors(folder: Path) -> weight_cache.LazyWeights:
    """The tensors of a Hugging Face folder's *.safetensors files (the weight caches beside them
    left out), each read when the model takes it: a float32 model then holds its own weights and
    one layer's pieces, a bfloat16 one never the float32 model."""
    return weight_cache.LazyWeights(weight_cache.source_files(folder))


def random_weights(config: LlamaConfig, device: str | torch.device, seed: int = 0) -> dict:
    """A Hugging Face-named float32 state dict of random weights with `config`'s shapes."""
    c = config
    meta = torch.device(device).type == "meta"  # shapes alone (`launches`): no generator there
    g = None if meta else torch.Generator(device=device).manual_seed(seed)
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * 0.02

    w = {"model.embed_tokens.weight": normal(c.vocab_size, h)}
    w["model.norm.weight"] = torch.full((h,), 1.0 - c.norm_offset, device=device)
    if not c.tie_embeddings:
        w["lm_head.weight"] = normal(c.vocab_size, h)
    for n in range(c.num_layers):
        p, a = f"model.layers.{n}.", f"model.layers.{n}.self_attn."
        heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
        for name, rows in ((name, n_heads * d) for name, n_heads in heads.items()):
            w[a + f"{name}_proj.weight"] = normal(rows, h)
            if c.qkv_bias:
                w[a + f"{name}_proj.bias"] = normal(rows)
        w[a + "o_proj.weight"] = normal(h, c.num_heads * d)
        if c.qk_norm:
            for x, n_heads in (("q", c.num_heads), ("k", c.num_kv_heads)):
                span = n_heads * d if c.qk_norm_whole else d
                w[a + f"{x}_norm.weight"] = torch.full((span,), 1.0 - c.norm_offset, device=device)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if c.pre_norms else [])
        if c.sandwich_norms:
            norms += ["post_feedforward_layernorm"]
            norms += ["pre_feedforward_layernorm"] if c.pre_norms else []
        for name in norms:  # a scale of 1, however the model stores it
            w[p + f"{name}.weight"] = torch.full((h,), 1.0 - c.norm_offset, device=device)
    return w
