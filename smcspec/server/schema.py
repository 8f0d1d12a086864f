"""Request bodies of the OpenAI-compatible API, with smcspec's decoding settings as extra fields
(named as on the CLI). Unknown fields are refused, so a typo never passes silently, and types are
strict (`"n": true`, `"stream": "true"`, `"seed": 1.0` are refused, not coerced); OpenAI fields
that smcspec does not implement are accepted only at their neutral value. Collections stop at
their first bad item: pydantic otherwise builds an error for every item with the GIL held (a
list of a million wrong ids took seconds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from smcspec.config import MAX_LOGPROBS, PROPOSALS, RESAMPLING_SCHEMES, VERIFY_RULES
from smcspec.engine import method_names

MAX_STOPS = 4
MAX_LOGIT_BIAS = 1024  # token ids a request may bias
MAX_CHOICES = 16
MAX_TOTAL_CHOICES = 64  # prompts x n
# Validation holds the GIL (and so the event loop) for ~6 us a message: 4096 take ~25 ms.
MAX_MESSAGES = 4096
Texts = Annotated[list[str], Field(fail_fast=True)]
TokenIds = Annotated[list[int], Field(fail_fast=True)]


def _method_names(schema: dict[str, Any]) -> None:
    """The documented choices of `method`: the method table's rows when the schema is made."""
    schema["enum"] = [*method_names(), None]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": ...}."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Texts | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1 - MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS, fail_fast=True)
    response_format: ResponseFormat | None = None
    # vLLM's: the prompt tokens' log-probabilities (in the choice's `prompt_logprobs`)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # smcspec's own settings, named as on the CLI. Their values are checked once, where they
    # become typed configs (`engine.configs_from_fields`, against the method table), not here.
    method: str | None = Field(None, json_schema_extra=_method_names)
    particles: int | None = None
    draft_tokens: int | None = None
    verify: str | None = Field(None, json_schema_extra={"enum": list(VERIFY_RULES)})
    proposal: str | None = Field(None, json_schema_extra={"enum": list(PROPOSALS)})
    lookup_ngram: int | None = None
    resample_threshold: float | None = None
    resampling: str | None = Field(None, json_schema_extra={"enum": list(RESAMPLING_SCHEMES)})
    # auto (the default method) may choose smc too
    approximate: bool | None = None
    power_alpha: float | None = Field(None, gt=0, le=64)
    draft_temperature: float | None = Field(None, ge=0, le=2)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    return_particles: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerationFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_asked(self) -> int | None:
        """`SamplingConfig.logprobs`: alternatives per token, 0 for the token's own only, None
        when the request asks for no log-probabilities (each endpoint spells it its way)."""
        return None

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """`SamplingConfig.prompt_logprobs`."""
        return self.prompt_logprobs

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(GenerationFields):
    prompt: str | Texts | TokenIds = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (and its log-probabilities)
    suffix: str | None = Field(None, max_length=0)
    best_of: int | None = Field(None, ge=1, le=1)

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs  # echo scores the prompt it echoes
        return self.prompt_logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments always follow the schema here


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, fail_fast=True)  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's tool calls may omit it)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, fail_fast=True)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields for features smcspec lacks, accepted (and ignored) where they ask for nothing,
    # so clients that always send them work: nothing stored.
    metadata: dict[str, str] | None = Field(None, max_length=16, fail_fast=True)
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice asks for a call, but no tools are given")
        if names and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format and tools cannot be combined: give one of them")
        return self

    @property
    def tool_choice_value(self) -> str | dict:
        """tool_choice as `tools.grammar` takes it ("auto" when tools are given, else "none")."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("storing completions is not supported: store must be false")
        return store

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- vLLM's tokenizer routes -------------------------------------------------------------------


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a text, as vLLM takes it (`model` may be left out)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str = Field(..., min_length=1)
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages, through the chat template. No special tokens by default,
    as in vLLM: the template writes its own."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: TokenIds = Field(..., min_length=1)
