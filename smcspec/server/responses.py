"""What the server sends: OpenAI's response bodies (and vLLM's, for its tokenizer routes) as
pydantic models, with smcspec's own `smcspec` field on each choice.

A response is built as one of these models and sent as `model.model_dump()`. OpenAI sends some
keys as null (a choice's `logprobs`, a chunk's `finish_reason`, an error's `param`) and leaves
others out when they have no value (a message's `tool_calls`, a chunk's `usage`): a model names
the second kind in `_absent_when_none`; every other field is always sent, null included.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class Wire(BaseModel):
    """A part of a response body."""

    model_config = ConfigDict(extra="forbid")
    _absent_when_none: ClassVar[frozenset[str]] = frozenset()

    # No return annotation: pydantic would take it for the schema of every response in OpenAPI.
    @model_serializer(mode="wrap")
    def _leave_out(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        absent = self._absent_when_none
        return {k: v for k, v in data.items() if not (v is None and k in absent)}


# -- parts every generation response shares ----------------------------------------------------


@dataclass(frozen=True)
class Head:
    """The id, time and model every response and stream chunk of one request carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, chat: bool, model: str) -> Head:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(prefix + secrets.token_hex(12), int(time.time()), model)


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        total = prompt_tokens + completion_tokens
        return cls(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total
        )


class ParticleText(Wire):
    text: str
    weight: float | None  # null where the weight is not finite


class SmcspecExtension(Wire):
    """smcspec's field on every choice: the method that ran, its diagnostics (`GenerationResult
    .diagnostics`, non-finite numbers as null) and, when `return_particles` asks, every
    particle's text and normalised weight."""

    _absent_when_none = frozenset({"particles"})
    method: str
    diagnostics: dict[str, Any]
    particles: list[ParticleText] | None = None


@dataclass(frozen=True)
class Finished:
    """What a finished choice puts in its response: the finish reason, its token count (for
    `usage`) and the smcspec field."""

    reason: FinishReason
    tokens: int
    smcspec: SmcspecExtension


# -- log-probabilities (`server.logprobs` computes them) ----------------------------------------


class CompletionLogprobs(Wire):
    """The completions API's parallel lists; the prompt's first token has null entries."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(Wire):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Wire):
    content: list[TokenLogprob]


# -- tool calls --------------------------------------------------------------------------------


class CalledFunction(Wire):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Wire):
    id: str
    type: Literal["function"]
    function: CalledFunction


class StreamedToolCall(Wire):
    index: int
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Wire):
    _absent_when_none = frozenset({"tool_calls"})
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCall] | None = None


# -- whole responses ---------------------------------------------------------------------------


class CompletionChoice(Wire):
    _absent_when_none = frozenset({"prompt_logprobs"})
    index: int
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None
    text: str
    prompt_logprobs: CompletionLogprobs | None = None  # vLLM's, when asked
    smcspec: SmcspecExtension


class ChatChoice(Wire):
    _absent_when_none = frozenset({"prompt_logprobs"})
    index: int
    finish_reason: ChatFinishReason
    logprobs: ChatLogprobs | None
    message: AssistantMessage
    prompt_logprobs: CompletionLogprobs | None = None
    smcspec: SmcspecExtension


class Completion(Wire):
    id: str
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None


class ChatCompletion(Wire):
    id: str
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None


# -- stream chunks -----------------------------------------------------------------------------


class CompletionChunkChoice(Wire):
    """A piece of a choice's text; the last one has the finish reason, the log-probabilities of
    every token and the smcspec field."""

    _absent_when_none = frozenset({"smcspec"})
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    smcspec: SmcspecExtension | None = None


class RoleDelta(Wire):
    role: Literal["assistant"]
    content: Literal[""]


class TextDelta(Wire):
    """A piece of the reply's text; empty (`{}`) in the chunk that ends a choice."""

    _absent_when_none = frozenset({"content"})
    content: str | None = None


class ToolCallsDelta(Wire):
    """A tool-calling reply, sent whole at its end: its text and its calls, if it made any."""

    _absent_when_none = frozenset({"tool_calls"})
    content: str | None
    tool_calls: list[StreamedToolCall] | None = None


class ChatOpeningChoice(Wire):
    """The first chunk of each chat choice: the role, before any text."""

    index: int
    delta: RoleDelta
    finish_reason: None


class ChatChunkChoice(Wire):
    _absent_when_none = frozenset({"smcspec"})
    index: int
    delta: TextDelta | ToolCallsDelta
    finish_reason: ChatFinishReason | None
    logprobs: ChatLogprobs | None
    smcspec: SmcspecExtension | None = None


class CompletionChunk(Wire):
    """One server-sent event of a streamed completion; the last, when `stream_options` asks,
    has no choices and the usage."""

    _absent_when_none = frozenset({"usage"})
    id: str
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatCompletionChunk(Wire):
    _absent_when_none = frozenset({"usage"})
    id: str
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatOpeningChoice | ChatChunkChoice]
    usage: Usage | None = None


# -- the other routes --------------------------------------------------------------------------


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ReplicaHealth(Wire):
    """One replica's row in /health when the engine is one of several (`server.cluster`)."""

    replica: str
    pid: int
    scheduler_alive: bool
    running: int
    queued: int
    kv_pages_in_use: int
    age_s: float  # since the replica last pushed this row


class Limits(Wire):
    """What the server runs within: the engine's limits (`config.EngineLimits`; the KV pool as
    built, null without a paged pool) and the HTTP ones (`config.HTTPLimits`)."""

    max_running: int
    max_batch_tokens: int
    kv_pages: int | None
    page_size: int | None
    max_body_bytes: int
    shutdown_timeout: float
    read_timeout: float
    write_timeout: float


class Health(Wire):
    _absent_when_none = frozenset({"replica", "replicas"})
    status: Literal["ok", "degraded"]
    model: str
    target: str
    draft: str
    backend: str
    dtype: str
    scheduler_alive: bool
    running: int
    queued: int
    limits: Limits
    replica: str | None = None
    replicas: list[ReplicaHealth] | None = None


class Tokenized(Wire):
    """vLLM's /tokenize answer; `max_model_len` is null when the model states no context."""

    count: int
    max_model_len: int | None
    tokens: list[int]


class Detokenized(Wire):
    prompt: str


class ErrorDetail(Wire):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Wire):
    """OpenAI's error body, of every refused request and of a stream's error event."""

    error: ErrorDetail

    @classmethod
    def of(
        cls,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> ErrorResponse:
        return cls(error=ErrorDetail(message=message, type=kind, param=param, code=code))
