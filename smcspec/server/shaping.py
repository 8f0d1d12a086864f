"""From finished choices to the response models of `server.responses`: a whole (non-streamed)
completion or chat completion, and the parts a stream's closing chunks share with it (the
echoed prompt, log-probabilities, tool calls)."""

from __future__ import annotations

from smcspec.engine import GenerationResult
from smcspec.server import tools
from smcspec.server.logprobs import logprobs_view, prompt_logprobs_view
from smcspec.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Finished,
    Head,
    ToolCallsDelta,
    Usage,
)
from smcspec.server.runtime import Choice, Server
from smcspec.server.schema import ChatRequest, CompletionRequest, GenerationFields


def whole(
    server: Server,
    body: GenerationFields,
    choices: list[Choice],
    results: list[GenerationResult],
    head: Head,
    prompt_tokens: int,
) -> Completion | ChatCompletion:
    """The response to a request that did not ask to stream, once every choice has finished."""
    chat = isinstance(body, ChatRequest)
    shape = _chat_choice if chat else _completion_choice
    shaped: list[CompletionChoice | ChatChoice] = []
    completion_tokens = 0
    for choice, result in zip(choices, results, strict=True):
        finished = server.finish(result, body.return_particles)
        completion_tokens += finished.tokens
        shaped.append(shape(server, body, choice, result, finished))
    usage = Usage.of(prompt_tokens, completion_tokens)
    kind = ChatCompletion if chat else Completion
    return kind(**vars(head), choices=shaped, usage=usage, system_fingerprint=None)


def _completion_choice(
    server: Server,
    body: GenerationFields,
    choice: Choice,
    result: GenerationResult,
    finished: Finished,
) -> CompletionChoice:
    return CompletionChoice(
        index=choice.index,
        finish_reason=finished.reason,
        logprobs=logprobs_of(server, body, choice, result),
        text=echo_text(server, body, choice) + result.text,
        prompt_logprobs=_prompt_logprobs(server, body, choice, result),
        smcspec=finished.smcspec,
    )


def _chat_choice(
    server: Server,
    body: GenerationFields,
    choice: Choice,
    result: GenerationResult,
    finished: Finished,
) -> ChatChoice:
    message, reason = assistant_message(body, result.text, finished.reason)
    return ChatChoice(
        index=choice.index,
        finish_reason=reason,
        logprobs=logprobs_of(server, body, choice, result),
        message=message,
        prompt_logprobs=_prompt_logprobs(server, body, choice, result),
        smcspec=finished.smcspec,
    )


def logprobs_of(
    server: Server, body: GenerationFields, choice: Choice, result: GenerationResult
) -> ChatLogprobs | CompletionLogprobs | None:
    """The choice's token log-probabilities in its endpoint's shape (None: not asked)."""
    chat = isinstance(body, ChatRequest)
    view = logprobs_view(server.llm.decode_text, result, chat, echoed(body, choice))
    if view is None:
        return None
    return ChatLogprobs.model_validate(view) if chat else CompletionLogprobs.model_validate(view)


def _prompt_logprobs(
    server: Server, body: GenerationFields, choice: Choice, result: GenerationResult
) -> CompletionLogprobs | None:
    if body.prompt_logprobs is None:
        return None
    view = prompt_logprobs_view(server.llm.decode_text, choice.plan.prompt_ids, result)
    return None if view is None else CompletionLogprobs.model_validate(view)


def assistant_message(
    body: GenerationFields, text: str, reason: str
) -> tuple[AssistantMessage, str]:
    """The reply, its tool calls parsed out when the request has tools, and its finish reason
    ("tool_calls" when it made any)."""
    message, reason = tools.reply(body, text, reason)
    return AssistantMessage.model_validate(message), reason


def tool_calls_delta(body: GenerationFields, text: str, reason: str) -> tuple[ToolCallsDelta, str]:
    """A tool-calling reply as the one delta that streams it, at its end."""
    delta, reason = tools.streamed_reply(body, text, reason)
    return ToolCallsDelta.model_validate(delta), reason


def echoed(body: GenerationFields, choice: Choice) -> list[int] | None:
    """The prompt ids a completion echoes (None: no echo)."""
    echo = isinstance(body, CompletionRequest) and body.echo
    return choice.plan.prompt_ids if echo else None


def echo_text(server: Server, body: GenerationFields, choice: Choice) -> str:
    """The prompt as the client sent it, before an echoing completion's text ("" otherwise)."""
    if echoed(body, choice) is None:
        return ""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, str) for p in prompt):
        return prompt[choice.index // body.n]
    return server.llm.decode_text(choice.plan.prompt_ids)
