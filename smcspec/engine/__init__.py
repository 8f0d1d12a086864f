"""The engine: the user-facing `LLM`, the scheduler that batches concurrent requests, model
loading (`load_pair` and the spec helpers in `loading`), the typed statistics each method
returns, `start_cache` (a model's cache holding a prompt: what benchmarks time forward
passes over), `fresh_logits` (one pass from an empty cache: what benchmarks score texts
with), and the method table's readers (`decoding.methods`: the methods' names and rows, and
the one converter from loose settings to typed configs). The command lines, the server and
the benchmarks import from here."""

from smcspec.decoding.auto_contract import AutoStats, setting_label
from smcspec.decoding.base import ARStats, MSDStats, SDStats, SMCStats, Stats, start_cache
from smcspec.decoding.methods import (
    configs_from_fields,
    lookahead,
    method_fields,
    method_names,
    method_row,
)
from smcspec.decoding.methods import resolve as resolve_method
from smcspec.engine.llm import LLM
from smcspec.engine.loading import (
    BACKENDS,
    DTYPES,
    Pair,
    check_same_tokenizer,
    gguf_files,
    load_pair,
)
from smcspec.engine.request import Request
from smcspec.engine.result import GenerationResult
from smcspec.models.base import CausalLM, PagedModel, fresh_logits

__all__ = [
    "BACKENDS",
    "DTYPES",
    "LLM",
    "ARStats",
    "AutoStats",
    "CausalLM",
    "GenerationResult",
    "MSDStats",
    "PagedModel",
    "Pair",
    "Request",
    "SDStats",
    "SMCStats",
    "Stats",
    "check_same_tokenizer",
    "configs_from_fields",
    "fresh_logits",
    "gguf_files",
    "load_pair",
    "lookahead",
    "method_fields",
    "method_names",
    "method_row",
    "resolve_method",
    "setting_label",
    "start_cache",
]
