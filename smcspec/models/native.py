"""The decoders' view of the native engine: `NativeCausalLM`, a `PagedModel` over `LlamaModel`.

Each cache (a decoder's rows) is a set of sequences in one shared page pool; `forward_many` runs
the calls of several caches (several requests) as one batch. On CUDA, decode-like batches (any
mix of steps, up to a token bucket) replay graphs captured when the model is built
(`graphs.GraphRunner`); everything else runs eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from smcspec.config import DEFAULT_KV_PAGES, EngineLimits
from smcspec.kv.cache import PagedKVCache
from smcspec.kv.pages import OutOfPages
from smcspec.models.graphs import TOKEN_BUCKETS, Capture, CudaCapture, GraphRunner
from smcspec.models.llama import LlamaModel
from smcspec.models.prefill import stack_padded


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
    """`PagedModel` over `LlamaModel`. `graphs`: replay CUDA graphs of decode-like passes (on a
    CUDA model whose attention allows it; `capture` replaces the CUDA capture, for tests), one
    per total-token count of `graph_buckets`, all captured here, before any request."""

    def __init__(
        self,
        model: LlamaModel,
        eos_token_ids: set[int],
        num_pages: int = DEFAULT_KV_PAGES,
        page_size: int = EngineLimits.page_size,
        graphs: bool = True,
        capture: Capture | None = None,
        graph_buckets: tuple[int, ...] = TOKEN_BUCKETS,
    ) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = model.context_length
        self.device = model.device
        self.kv = model.new_kv(num_pages, page_size)
        self.pages = self.kv.allocator
        self.page_size = page_size
        self.graphs: GraphRunner | None = None
        on_gpu = model.device.type == "cuda" and model.attention.graph_safe
        if graphs and (capture is not None or on_gpu):
            capture = capture or CudaCapture()
            self.graphs = GraphRunner(model, self.kv, self.context_length, capture, graph_buckets)
            self.graphs.capture_all()

    @property
    def graph_replays(self) -> int:
        """Passes served by a graph replay so far."""
        return 0 if self.graphs is None else self.graphs.replays

    def new_cache(self) -> NativeCache:
        return NativeCache(self.kv)

    def forward(self, tokens: torch.Tensor, cache: NativeCache, num_logits: int) -> torch.Tensor:
        return self.forward_many([(tokens, cache, num_logits)])[0]

    def forward_many(
        self, calls: list[tuple[torch.Tensor, NativeCache, int]]
    ) -> list[torch.Tensor]:
        """`forward` for each (tokens [B_c, T_c], cache, num_logits_c), in one pass over the
        weights; returns each call's float32 logits [B_c, num_logits_c, V] on the model's
        device."""
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
        try:
            logits = self._forward_rows(seqs, rows, wants)
        except OutOfPages as err:  # mid-decode: the user can only act on it by the pool's size
            raise OutOfPages(
                f"{err} ({self.pages.num_pages} pages x {self.page_size} positions): give a "
                "larger pool (--kv-pages or --kv-memory; EngineLimits.kv_pages or kv_memory)"
            ) from err
        out, start = [], 0
        for tokens, _, num_logits in calls:
            out.append(stack_padded(logits[start : start + tokens.shape[0]], num_logits))
            start += tokens.shape[0]
        return out

    def _forward_rows(
        self, seqs: list[int], rows: list[torch.Tensor], wants: list[int]
    ) -> list[torch.Tensor]:
        """Each row's logits, by a graph replay where one fits, else eagerly."""
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(seqs, rows, wants)
        if logits is None:
            logits = self.model.forward_ragged(self.kv, seqs, rows, wants)
        return logits


def build(
    models: Sequence[tuple[LlamaModel, set[int]]], limits: EngineLimits, graphs: bool = True
) -> list[NativeCausalLM]:
    """A `NativeCausalLM` per (model, EOS ids), each with a pool of `pool_pages` pages: sized
    once every model's weights are in memory, so that `kv_memory` shares what they leave."""
    pages = pool_pages([model for model, _ in models], limits)
    return [NativeCausalLM(m, eos, pages, limits.page_size, graphs) for m, eos in models]


def pool_pages(models: Sequence[LlamaModel], limits: EngineLimits) -> int:
    """Pages of each model's pool (all get as many: a request holds as many positions in
    each). `kv_memory` x the free bytes of the models' device, over the bytes one page costs
    in all the pools, less the scratch page each pool holds beyond its pages. A size the user
    set is refused, before anything is allocated, if one sequence of a model's full context
    would not fit."""
    if limits.kv_pages is None and limits.kv_memory is None:
        return DEFAULT_KV_PAGES
    pages, flag = limits.kv_pages, "--kv-pages"
    if limits.kv_memory is not None:
        budget = limits.kv_memory * free_bytes(models[0].device)
        per_page = sum(page_bytes(m, limits.page_size) for m in models)
        pages, flag = int(budget // per_page) - 1, "--kv-memory"
    assert pages is not None
    for model in models:
        context = model.context_length
        if pages * limits.page_size < context:
            raise ValueError(
                f"a KV pool of {max(pages, 0)} pages x {limits.page_size} positions cannot hold "
                f"one sequence of the model's context ({context} positions, "
                f"{-(-context // limits.page_size)} pages): raise {flag}"
            )
    return pages


def page_bytes(model: LlamaModel, page_size: int) -> int:
    """Bytes of one page of `model`'s pool: K and V of `page_size` positions in every layer, in
    the activations' dtype (int8 weights keep a float32 cache: `weight_cache` holds weights only,
    their scales included, and no KV)."""
    c = model.config
    return 2 * c.num_layers * page_size * c.num_kv_heads * c.head_dim * model.act_dtype.itemsize


def free_bytes(device: torch.device) -> int:
    """Bytes free on `device`: the GPU's free memory, or the RAM available on a CPU."""
    if device.type == "cuda":
        # blocks torch still caches from the load's temporaries are free to the pool too
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError) as err:
        raise ValueError(
            "kv_memory: this machine does not tell its free RAM; size the pool with kv_pages"
        ) from err
