"""The engine: the user-facing `LLM`, the scheduler that batches concurrent requests, and
`start_cache` (a model's cache holding a prompt: what benchmarks time forward passes over)."""

from smcspec.decoding.base import start_cache
from smcspec.engine.llm import LLM, GenerationResult, check_same_tokenizer
from smcspec.engine.request import Request

__all__ = ["LLM", "GenerationResult", "Request", "check_same_tokenizer", "start_cache"]
