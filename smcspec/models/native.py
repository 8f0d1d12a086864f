"""The decoders' view of the native engine: `NativeCausalLM`, a `PagedModel` over `LlamaModel`.

Each cache (a decoder's rows) is a set of sequences in one shared page pool; `forward_many` runs
the calls of several caches (several requests) as one batch. On CUDA, decode-like batches (any
mix of steps, up to a token bucket) replay graphs captured when the model is built
(`graphs.GraphRunner`); everything else runs eagerly.
"""

from __future__ import annotations

import torch

from smcspec.kv.cache import PagedKVCache
from smcspec.models.graphs import TOKEN_BUCKETS, Capture, CudaCapture, GraphRunner
from smcspec.models.llama import LlamaModel, stack_padded


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
        num_pages: int = 4096,
        page_size: int = 16,
        graphs: bool = True,
        capture: Capture | None = None,
        graph_buckets: tuple[int, ...] = TOKEN_BUCKETS,
    ) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = model.config.max_positions
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
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(seqs, rows, wants)
        if logits is None:
            logits = self.model.forward_ragged(self.kv, seqs, rows, wants)
        out, start = [], 0
        for tokens, _, num_logits in calls:
            out.append(stack_padded(logits[start : start + tokens.shape[0]], num_logits))
            start += tokens.shape[0]
        return out
