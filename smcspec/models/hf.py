"""Hugging Face `transformers` backend: any causal LM from a hub id, a local folder or a .gguf file.

The KV cache is a `DynamicCache` kept across rounds; picking rows is an index-select along the batch
dimension and rollback crops the sequence dimension.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from smcspec.models import prefill
from smcspec.models.llama import PREFILL_CHUNK

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCache:
    def __init__(self) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self._batch = 1
        self._length = 0

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def length(self) -> int:
        return self._length

    def select(self, rows: torch.Tensor) -> None:
        if self._length > 0:
            self.kv.reorder_cache(rows)
        self._batch = int(rows.numel())

    def crop(self, length: int) -> None:
        if length < self._length:
            self.kv.crop(length - self._length)
            self._length = length

    def release(self) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self._batch, self._length = 1, 0

    def advance(self, tokens: int) -> None:
        self._length += tokens


class HFCausalLM:
    """Adapts a `transformers` causal LM to the `CausalLM` interface."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: set[int]) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = next(model.parameters()).device
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        # transformers renamed `past_key_values` to `cache` in 5.x; accept either release.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> HFCache:
        return HFCache()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, num_logits: int) -> torch.Tensor:
        if cache.length == 0:  # an empty cache takes the batch size of its first forward
            cache.select(torch.zeros(tokens.shape[0], dtype=torch.long))
        assert tokens.shape[0] == cache.batch_size, "one row of tokens per cache row"
        pieces = []
        # A long feed in passes of at most PREFILL_CHUNK tokens, as the native engine does: one
        # pass over a whole prompt would hold its [T, T] attention scores at once. `keep`: the
        # pass's rows among the feed's last num_logits.
        for [(_, start, end, keep)] in prefill.chunks(
            [tokens.shape[1]], [num_logits], PREFILL_CHUNK
        ):
            out = self.model(
                input_ids=tokens[:, start:end].to(self.device),
                use_cache=True,
                logits_to_keep=max(keep, 1),  # 0 would mean every row to transformers
                **{self._cache_kwarg: cache.kv},
            )
            cache.advance(end - start)
            if keep:
                pieces.append(out.logits[:, -keep:].float().cpu())
        if not pieces:  # no token fed
            return torch.zeros(tokens.shape[0], 0, self.vocab_size)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or Path(spec).exists()


def check_spec(spec: str, role: str = "model") -> None:
    """Fail fast, before any loading, on a local path that cannot be a model."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{role}: give a hub id, a folder or a .gguf file, got {spec!r}")
    if not _looks_like_path(spec):
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"{role}: model path does not exist: {spec}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{role}: a model file must be .gguf, got {spec}")


def load(spec: str, dtype: str = "float32", device: str = "cpu") -> tuple[HFCausalLM, object]:
    """Load (model, tokenizer) from a hub id, a local folder or a .gguf file.

    Raises ValueError naming the problem if the path is missing or the model cannot be loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "int4":
        from smcspec.models.llama import SUPPORTED

        raise ValueError(f"int4 weights run on the native engine only ({', '.join(SUPPORTED)})")
    if dtype not in (*DTYPES, "int8"):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, int8, got {dtype!r}")
    check_spec(spec)
    kwargs: dict = {}
    source = spec
    if _looks_like_path(spec):
        path = Path(spec).expanduser()
        source = str(path)
        if path.is_file():
            source, kwargs["gguf_file"] = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        torch_dtype = DTYPES.get(dtype, torch.float32)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load model {spec!r}: {first_line}") from err
    model.to(device)
    causal_lm = HFCausalLM(model, eos_ids(model, tokenizer))
    if dtype == "int8":
        quantize_int8(model)
    return causal_lm, tokenizer


class _Int8Module(torch.nn.Module):
    """An `nn.Linear` replaced by the native engine's int8 linear (same kernels, same numbers)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        from smcspec.models.layers import Int8Linear

        super().__init__()
        self.inner = Int8Linear(linear.weight.detach(), linear.bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def quantize_int8(model: torch.nn.Module) -> None:
    """Every `nn.Linear` (lm_head included) to int8 weights with per-token int8 activations."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, _Int8Module(child))


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (chat models have two)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return collect_ids(gen_eos, tokenizer.eos_token_id)


def collect_ids(*values) -> set[int]:
    """The union of token ids given as ints, lists or None."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
