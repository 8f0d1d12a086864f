"""The kernel launches of one forward of the native model, counted without a GPU.

On a GPU a small model's decode step is bound by its kernel launches, not its weights: a 0.5B
step reads its weights in about 0.2 ms, while each launch costs 2-3 us even replayed from a
CUDA graph. `count_ops` runs `LlamaModel.hidden` and `logits` on the meta device (shapes only,
no memory, no arithmetic; not the CPU, so the model takes its GPU path) under a
`TorchDispatchMode`, which sees every op as it reaches the dispatcher, after composite ops have
decomposed into the ones a backend implements: on CUDA each of those is one or more kernels.

Not counted (`NO_LAUNCH`): views, which only make new metadata over the same storage, and
allocations, which the caching allocator serves without a kernel. Every other op counts as one
launch, so the count errs high (a cast to the same dtype launches nothing), never low. The
attention is a stub counted as `attention_launches` (the paged Triton kernel: one, or two with
a split-KV merge), since on the meta device there is no kernel to see.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smcspec.kv.cache import PagedKVCache
from smcspec.models.attention import ForwardBatch
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights

NO_LAUNCH = frozenset(
    {
        # views
        "aten.view", "aten._unsafe_view", "aten._reshape_alias", "aten.reshape", "aten.t",
        "aten.transpose", "aten.permute", "aten.expand", "aten.slice", "aten.select",
        "aten.unsqueeze", "aten.squeeze", "aten.split", "aten.split_with_sizes", "aten.chunk",
        "aten.narrow", "aten.as_strided", "aten.alias", "aten.detach", "aten.unbind",
        # allocations
        "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
        "aten.lift_fresh",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LaunchCount:
    """Launches of one forward, by op: those every layer repeats and those it makes once."""

    per_layer: dict[str, int]
    fixed: dict[str, int]  # embedding, RoPE table lookups, final norm, head, ...

    @property
    def layer(self) -> int:
        return sum(self.per_layer.values())

    def total(self, layers: int) -> int:
        return self.layer * layers + sum(self.fixed.values())


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        if name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _StubAttention:
    """What `PagedAttention` does on CUDA, as the count sees it: `launches` kernels."""

    name, paged, graph_safe = "stub", True, True

    def __init__(self, count: _Count, launches: int) -> None:
        self.count, self.launches = count, launches

    def __call__(
        self, q: torch.Tensor, kv: PagedKVCache, layer: int, batch: ForwardBatch, window: int = 0
    ) -> torch.Tensor:
        self.count.ops["attention"] += self.launches
        return torch.empty_like(q)  # [total, nh, d]


def _forward_ops(
    config: LlamaConfig, dtype: str, rows: int, t: int, fused: bool, attention_launches: int
) -> collections.Counter[str]:
    """Launches of `hidden` + `logits` over `rows` sequences appending `t` tokens each."""
    model = LlamaModel(config, random_weights(config, "meta"), dtype, "meta", "reference")
    model.fused = fused
    page_size = 16
    kv = model.new_kv(rows * -(-t // page_size) + 1, page_size)
    batch = model.plan(kv, [kv.new_sequence() for _ in range(rows)], [t] * rows)
    batch.attention = None  # the stub's, even for a feed the model would send to gather
    tokens = torch.zeros(rows * t, dtype=torch.long, device="meta")
    count = _Count()
    model.attention = _StubAttention(count, attention_launches)
    with count:
        model.logits(model.hidden(tokens, batch, kv))
    return count.ops


def count_ops(
    config: LlamaConfig,
    dtype: str,
    rows: int,
    t: int,
    *,
    fused: bool = True,
    attention_launches: int = 1,
) -> LaunchCount:
    """The launches of one forward (`hidden` + `logits`) of a model of `config`'s shapes in
    `dtype`, `rows` sequences of `t` new tokens, with the fused ops (the GPU path) or the plain
    torch ones (`fused=False`). Per layer: the difference between 2 and 1 layers, checked
    against 3 (the layers' cost must be linear in their number)."""
    ops = [
        _forward_ops(
            dataclasses.replace(config, num_layers=n), dtype, rows, t, fused, attention_launches
        )
        for n in (1, 2, 3)
    ]
    per_layer = _minus(ops[1], ops[0])
    assert _minus(ops[2], ops[1]) == per_layer, "a layer's launches depend on its index"
    return LaunchCount(per_layer, _minus(ops[0], per_layer))


def _minus(a: collections.Counter[str], b: collections.Counter[str] | dict[str, int]) -> dict:
    """a - b by op, negative counts kept (unlike Counter's): the first layer may make an op of
    the others in another form (the fused path's first input norm is a plain `rms_norm`, the
    others ride with the previous layer's residual add), which `fixed` then shows as -1."""
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys() if a.get(k, 0) != b.get(k, 0)}
