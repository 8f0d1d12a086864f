"""A layer's RMSNorms: on smcspec's CPU kernel (`csrc/cpu_norm.cpp`) where the layer's products
run there, else in plain torch (`fused.rms_reference`).

PyTorch's float32 RMSNorm is about seven ops (pow, mean, add, rsqrt, multiplies), each a few
microseconds of dispatch at a small model's hidden size, and a Gemma 3 layer normalises six
times (its block's input and output around attention and the MLP, each head's q and k): 3 ms
of a 17 ms Gemma 3 270M step on 2 Xeon cores. The kernel's is one call per norm (one for a
layer's q and k heads together), each row's sum in a fixed order of its own, so a row's
result does not depend on the rows beside it, as the kernel's attention's does not.
"""

from __future__ import annotations

from types import ModuleType

import torch

from smcspec.models.fused import rms_reference
from smcspec.models.llama_weights import Layer


class Norms:
    """`norm(x, weight, eps)`, an RMSNorm the layer may lack (x itself where weight is None),
    and `heads`, the norms of q and k within qkv."""

    def __init__(self, kernel: ModuleType | None = None) -> None:
        self._kernel = kernel
        self.rms = rms_reference if kernel is None else kernel.rms_norm

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., H] times weight [H]; x where there is no weight (the norms of a
        block's output, Gemma's and OLMo 2's; OLMo 2 has none before a block)."""
        return x if weight is None else self.rms(x, weight, eps)

    def heads(self, layer: Layer, qkv: torch.Tensor, nh: int, nkv: int, eps: float) -> torch.Tensor:
        """qkv [total, nh + 2 nkv, d] with the layer's RMSNorm of q and of k applied (before
        RoPE) over as much as its weight spans: each head's d (Qwen3's, Gemma's), or all of q's
        heads at once and all of k's (OLMo 2's); as it is where the layer has none."""
        if layer.q_norm is None or layer.k_norm is None:
            return qkv
        d = qkv.shape[-1]
        if self._kernel is not None and layer.q_norm.numel() == d:
            return self._kernel.head_norms(qkv, layer.q_norm, layer.k_norm, nh, nkv, eps)
        q, k = qkv[:, :nh], qkv[:, nh : nh + nkv]
        if layer.q_norm.numel() != d:  # over the whole projection
            q = self.rms(q.flatten(1), layer.q_norm, eps).view(q.shape)
            k = self.rms(k.flatten(1), layer.k_norm, eps).view(k.shape)
        else:
            q, k = self.rms(q, layer.q_norm, eps), self.rms(k, layer.k_norm, eps)
        return torch.cat([q, k, qkv[:, nh + nkv :]], dim=1)
