"""The engine: the user-facing `LLM` and the scheduler that batches concurrent requests."""

from smcspec.engine.llm import LLM, GenerationResult, Request, check_same_tokenizer

__all__ = ["LLM", "GenerationResult", "Request", "check_same_tokenizer"]
