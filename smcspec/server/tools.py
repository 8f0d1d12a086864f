"""Tool calling in the format of Qwen2.5's chat template (Hermes'): the tools are rendered by
the model's own template, and a reply that calls them is

    <tool_call>
    {"name": "<function>", "arguments": {...}}
    </tool_call>

once per call, separated by newlines. The reply is constrained by a grammar (llguidance):
`arguments` follow the function's JSON schema and `name` is one of the tools, so smc samples
the target's law conditioned on a well-formed call, and ar masks locally. The text is parsed
back into OpenAI's `tool_calls`.

tool_choice: "auto" (the default with tools) lets the reply be either text (not starting with
"<") or calls; "required" asks for at least one call; a named function for exactly one call
of it; "none" hides the tools from the model and leaves the reply free.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from typing import Any

from smcspec.server.schema import ChatRequest, GenerationFields

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def grammar_applies(tools: list[Any] | None, choice: str | dict) -> bool:
    """Whether a reply is constrained to (and parsed for) calls."""
    return bool(tools) and choice != "none"


def grammar(
    tools: list[dict[str, Any]], choice: str | dict, parallel: bool, special_tags: bool
) -> str | None:
    """The Lark grammar of a reply under `choice`, or None when nothing constrains it.
    special_tags: the tokenizer has <tool_call> and </tool_call> as tokens of their own,
    which the grammar must name as such."""
    if not grammar_applies(tools, choice):
        return None
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
        parallel = False
    opening, closing = (OPEN, CLOSE) if special_tags else (json.dumps(OPEN), json.dumps(CLOSE))
    lines = [
        # a newline may follow the last call, as the template ends calls with one
        "calls: call" + (' ("\\n" call)*' if parallel else "") + ' "\\n"?',
        f'call: {opening} "\\n" function "\\n" {closing}',
        "function: " + " | ".join(f"function_{i}" for i in range(len(functions))),
    ]
    lines += [f"function_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    if choice == "auto":
        lines = ["start: calls | text", "text: TEXT?", "TEXT: /[^<](.|\\n)*/", *lines]
    else:
        lines = ["start: calls", *lines]
    return "\n".join(lines) + "\n"


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    parameters = function.get("parameters") or no_parameters
    return {
        # spaced as the template shows calls to the model, and no other way
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text before the first call, or None if there is none; the calls in OpenAI's shape).
    A block that is not a well-formed call stays in the text."""
    head, sep, rest = text.partition(OPEN)
    if not sep:
        return text, []
    calls = []
    for block in (OPEN + rest).split(OPEN)[1:]:
        body, closed, _ = block.partition(CLOSE)
        try:
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            return text, []
        if not closed or not isinstance(name, str):
            return text, []
        function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
        calls.append(
            {"id": "call_" + secrets.token_hex(12), "type": "function", "function": function}
        )
    return (head.strip() or None), calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: an assistant's call arguments as objects
    (OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    with contextlib.suppress(ValueError):  # not JSON: the template shows the text as it came
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def replies_with_calls(body: GenerationFields) -> bool:
    """Whether a request's reply is constrained to, and parsed for, tool calls."""
    if not isinstance(body, ChatRequest):
        return False
    return grammar_applies(body.tools, body.tool_choice_value)


def reply(body: GenerationFields, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """The assistant's message and the finish reason: with tools, the calls the text makes
    become `tool_calls` (finish reason "tool_calls") and the text before them the content."""
    if not replies_with_calls(body):
        return {"role": "assistant", "content": text}, reason
    content, calls = parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def streamed_reply(body: GenerationFields, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """A tool-calling reply streamed at its end: one delta with its content and its calls
    (each with its index, as OpenAI streams them)."""
    message, reason = reply(body, text, reason)
    delta: dict[str, Any] = {"content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    return delta, reason
