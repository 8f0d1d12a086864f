"""What a checked request body gives the engine: the bound on its choices, chat messages as the
dicts a template takes, its sampling settings by name, and the JSON schema its
`response_format` asks for."""

from __future__ import annotations

import json
from typing import Any

from smcspec.config import SAMPLING_FIELDS
from smcspec.server.api_error import ApiError, check_unicode
from smcspec.server.schema import MAX_TOTAL_CHOICES, ChatMessage, GenerationFields


def check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_TOTAL_CHOICES:
        raise ApiError(
            f"{prompts} prompts x n = {n} make {prompts * n} choices: at most "
            f"{MAX_TOTAL_CHOICES} per request",
            "prompt" if prompts > MAX_TOTAL_CHOICES else "n",
        )


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The dicts a chat template takes (role, content, and a call's or a tool message's
    fields where given), each text checked to be valid Unicode."""
    out = []
    for i, m in enumerate(messages):
        parts = [m.content] if isinstance(m.content, str) else [p.text for p in m.content or []]
        for j, text in enumerate(parts):
            suffix = "" if isinstance(m.content, str) else f".{j}.text"
            check_unicode(text, f"messages.{i}.content{suffix}")
        message = {"role": m.role, "content": m.text if m.content is not None else None}
        extra = m.model_dump(include={"tool_calls", "tool_call_id", "name"}, exclude_none=True)
        out.append(message | extra)
    return out


def sampling(body: GenerationFields, temperature: float) -> dict[str, Any]:
    """The `SamplingConfig` fields the request gives by name (the dataclass's defaults for the
    rest, but the server's own default temperature), so a new field needs only its schema
    field. max_new_tokens and seed are per choice."""
    own = {"logprobs", "prompt_logprobs"}  # each endpoint spells them its way
    given = {name: getattr(body, name, None) for name in SAMPLING_FIELDS if name not in own}
    given = {name: value for name, value in given.items() if value is not None}
    spelled = {
        "stop_at_eos": not body.ignore_eos,
        "logprobs": body.top_logprobs_asked,
        "prompt_logprobs": body.prompt_logprobs_asked,
    }
    return {"temperature": temperature} | given | spelled


def response_schema(body: GenerationFields) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    return json.dumps(fmt.json_schema.schema_)
