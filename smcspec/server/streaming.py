"""A streamed response: server-sent events of chunks, each with the text that can no longer
change (committed tokens for ar and sd, the particles' common prefix for smc), then per choice
a closing chunk with its finish reason, log-probabilities and smcspec field, the usage when
`stream_options` asks, and `data: [DONE]`. A choice that fails sends an error event instead of
its closing chunk; the others go on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from smcspec.server import shaping, tools
from smcspec.server.api_error import ApiError
from smcspec.server.jobs import outcome, submit_all
from smcspec.server.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatOpeningChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    ErrorResponse,
    Head,
    RoleDelta,
    SmcspecExtension,
    TextDelta,
    ToolCallsDelta,
    Usage,
    Wire,
)
from smcspec.server.runtime import Choice, Server
from smcspec.server.schema import ChatRequest, GenerationFields

DONE = "data: [DONE]\n\n"


def sse(body: Wire) -> str:
    return f"data: {json.dumps(body.model_dump())}\n\n"


def response(
    server: Server,
    body: GenerationFields,
    choices: list[Choice],
    head: Head,
    prompt_tokens: int,
    started: float,
) -> StreamingResponse:
    """Submit the choices and stream them: each job's text deltas, then its end (None), reach
    the event loop through one queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    def on_text(index: int, delta: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, delta))

    submit_all(server, choices, on_text)
    for c in choices:
        c.job.future.add_done_callback(
            lambda _, i=c.index: loop.call_soon_threadsafe(queue.put_nowait, (i, None))
        )
    events = _events(server, body, choices, queue, Chunks(head, body), prompt_tokens, started)
    return StreamingResponse(events, media_type="text/event-stream")


class Chunks:
    """The chunks of one request's stream, each with the request's head, as events."""

    def __init__(self, head: Head, body: GenerationFields) -> None:
        self.head = head
        self.chat = isinstance(body, ChatRequest)

    def opening(self, index: int) -> str:
        """A chat choice's first chunk: the role, before any text."""
        delta = RoleDelta(role="assistant", content="")
        return self._event([ChatOpeningChoice(index=index, delta=delta, finish_reason=None)])

    def text(self, index: int, text: str) -> str:
        return self._event([self._choice(index, text)])

    def tool_calls(self, index: int, delta: ToolCallsDelta) -> str:
        """A tool-calling reply, held back until the choice ended."""
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=None, logprobs=None)
        return self._event([choice])

    def closing(
        self,
        index: int,
        reason: str,
        smcspec: SmcspecExtension,
        logprobs: ChatLogprobs | CompletionLogprobs | None,
    ) -> str:
        """A choice's last chunk, after all its text."""
        return self._event([self._choice(index, None, reason, logprobs, smcspec)])

    def usage(self, usage: Usage) -> str:
        return self._event([], usage)

    def _choice(
        self,
        index: int,
        text: str | None,
        reason: str | None = None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
        smcspec: SmcspecExtension | None = None,
    ) -> ChatChunkChoice | CompletionChunkChoice:
        if self.chat:
            delta = TextDelta(content=text)
            return ChatChunkChoice(
                index=index, delta=delta, finish_reason=reason, logprobs=logprobs, smcspec=smcspec
            )
        return CompletionChunkChoice(
            index=index, text=text or "", finish_reason=reason, logprobs=logprobs, smcspec=smcspec
        )

    def _event(self, choices: list, usage: Usage | None = None) -> str:
        kind = ChatCompletionChunk if self.chat else CompletionChunk
        return sse(kind(**vars(self.head), choices=choices, usage=usage))


async def _events(
    server: Server,
    body: GenerationFields,
    choices: list[Choice],
    queue: asyncio.Queue[tuple[int, str | None]],
    chunks: Chunks,
    prompt_tokens: int,
    started: float,
) -> AsyncIterator[str]:
    hold = tools.replies_with_calls(body)  # calls are parsed from the whole reply, sent at its end
    open_choices = {c.index for c in choices}
    completion_tokens, first = 0, True
    try:
        for event in _openings(server, body, choices, chunks):
            yield event
        while open_choices:
            index, delta = await queue.get()
            if delta is not None:
                if first:
                    server.metrics.first_token.observe(time.perf_counter() - started)
                    first = False
                if not hold:
                    yield chunks.text(index, delta)
                continue
            open_choices.discard(index)
            events, used = _closing(server, body, choices[index], chunks)
            completion_tokens += used
            for event in events:
                yield event
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunks.usage(Usage.of(prompt_tokens, completion_tokens))
        server.metrics.latency.observe(time.perf_counter() - started)
        yield DONE
    finally:  # the stream ended, or its client left (the guard counts that)
        for c in choices:
            c.job.cancel()


def _openings(
    server: Server, body: GenerationFields, choices: list[Choice], chunks: Chunks
) -> list[str]:
    """What comes before any generated text: each chat choice's role, then each echoed
    prompt."""
    events = [chunks.opening(c.index) for c in choices] if chunks.chat else []
    for c in choices:
        if shaping.echoed(body, c) is not None:
            events.append(chunks.text(c.index, shaping.echo_text(server, body, c)))
    return events


def _closing(
    server: Server, body: GenerationFields, choice: Choice, chunks: Chunks
) -> tuple[list[str], int]:
    """The last events of a finished choice (a held tool-calling reply, then the chunk with its
    finish reason; or an error event) and its token count."""
    try:
        result = outcome(server, choice.job.future)
    except ApiError as err:
        return [sse(ErrorResponse.of(err.message, err.param, err.code, err.kind))], 0
    except Exception as err:
        return [sse(ErrorResponse.of(f"generation failed: {err}", kind="server_error"))], 0
    finished = server.finish(result, body.return_particles)
    events, reason = [], finished.reason
    if tools.replies_with_calls(body):
        delta, reason = shaping.tool_calls_delta(body, result.text, reason)
        events.append(chunks.tool_calls(choice.index, delta))
    # every token's log-probability comes with the last chunk, which follows the text
    logprobs = shaping.logprobs_of(server, body, choice, result)
    events.append(chunks.closing(choice.index, reason, finished.smcspec, logprobs))
    return events, finished.tokens
