"""The OpenAI-compatible HTTP server.

    app = create_app(llm, ServeDefaults(model_name="my-model"))
    HTTPServer(app, "127.0.0.1", 8000).run()

Every choice of every request is one scheduler job (see `engine.scheduler`), so concurrent
requests share forward passes, each with its own method and settings. Streaming sends the text
that can no longer change: committed tokens for ar and sd, the particles' common prefix for smc,
and the rest once the final particle is drawn.

Parsing, templating, tokenizing and planning run in worker threads, and `bodies` bounds the
work of decoding a body before it starts, so a large body never holds up the event loop; bodies
over `max_body_bytes`, and requests without the server's API key (when it has one), are refused
before anything reads them; `connection` caps request heads and times reads and writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from smcspec.engine import LLM, GenerationResult
from smcspec.engine.scheduler import Cancelled
from smcspec.server import tools
from smcspec.server.bodies import BodyReader
from smcspec.server.cluster import ReplicaView
from smcspec.server.connection import h11_protocol
from smcspec.server.guard import Guard
from smcspec.server.logprobs import logprobs_view, prompt_logprobs_view
from smcspec.server.runtime import (
    ApiError,
    Choice,
    ServeDefaults,
    Server,
    error_body,
    public_name,
    result_of,
)
from smcspec.server.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

__all__ = ["HTTPServer", "ServeDefaults", "create_app"]

POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
CLOSE_S = 2.0  # after the grace period, how long cancelled requests get to send their errors
LOG = logging.getLogger("smcspec.server")


async def _gather(
    server: Server, choices: list[Choice], request: HTTPRequest
) -> list[GenerationResult]:
    """Wait for every choice's job; cancel them all if the client goes away."""
    futures = [asyncio.wrap_future(c.job.future) for c in choices]
    for future in futures:
        future.add_done_callback(_retrieved)
    try:
        while True:
            _, pending = await asyncio.wait(futures, timeout=POLL_S)
            if not pending:
                break
            if await request.is_disconnected():
                server.metrics.count_disconnect("waiting")
                raise Cancelled("the client went away")
        return [_outcome(server, f) for f in futures]
    finally:
        for c in choices:
            c.job.cancel()


def _retrieved(future: asyncio.Future) -> None:
    """Mark a job's outcome as seen: a cancelled job's exception would otherwise be logged with
    its traceback when the future is collected ("exception was never retrieved"), and Python
    3.11 formats tracebacks with `ast`, which is not safe beside another thread's `ast` use."""
    if not future.cancelled():
        future.exception()


def _outcome(server: Server, future) -> GenerationResult:
    try:
        return result_of(future)
    except Cancelled as err:
        raise server.failure(err) or err from err


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


# -- the app ----------------------------------------------------------------------------------


def _body_schema(*names: str) -> dict:
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


BODIES = (
    CompletionRequest,
    ChatRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)


def _with_body_schemas(app: FastAPI) -> None:
    """The bodies are parsed off the event loop, not by FastAPI: add their schemas to OpenAPI."""
    plain = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = plain()
            models = [(body, "validation") for body in BODIES]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _health(server: Server, llm: LLM, defaults: ServeDefaults) -> dict[str, Any]:
    """What /health reports: the models, and whether the scheduler's thread is alive."""
    s = server.scheduler
    alive = s.alive
    return {
        "status": "ok" if alive else "degraded",
        "model": defaults.model_name,
        "target": public_name(llm.names[0]),
        "draft": public_name(llm.names[1]),
        "backend": llm.backend,
        "dtype": llm.dtype,
        "scheduler_alive": alive,
        "running": s.running,
        "queued": s.queued,
    }


def create_app(
    llm: LLM, defaults: ServeDefaults, replica: Callable[[Server], ReplicaView] | None = None
) -> FastAPI:
    """The OpenAI app over one engine. `replica`, when the engine is one of several replicas
    (`server.ray_app`), makes the view through which /health lists every replica and /metrics
    serves all their metrics, each labelled `replica`."""
    server = Server(llm, defaults)
    bodies = BodyReader(server.context_length)
    view = None if replica is None else replica(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if view is not None:
            view.start()
        yield
        if view is not None:
            view.stop()
        server.shutdown()

    app = FastAPI(title="smcspec", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Guard, server=server)
    _add_error_handlers(app)
    _with_body_schemas(app)

    def completion(raw: bytes) -> tuple[GenerationFields, list[Choice]]:
        body = bodies.parse(raw, CompletionRequest)
        server.check_model(body.model)
        return body, server.plan(body, server.completion_prompts(body), "prompt")

    def chat_completion(raw: bytes) -> tuple[GenerationFields, list[Choice]]:
        body = bodies.parse(raw, ChatRequest)
        server.check_model(body.model)
        return body, server.plan(body, server.chat_prompt(body), "messages")

    @app.get("/health")
    async def health() -> Response:
        report = _health(server, llm, defaults)
        if view is not None:
            report.update(await run_in_threadpool(view.health))
        return JSONResponse(report, status_code=200 if report["scheduler_alive"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.render() if view is None else await run_in_threadpool(view.render)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": defaults.model_name, "object": "model", "created": server.created}
        return {"object": "list", "data": [{**card, "owned_by": "smcspec"}]}

    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: HTTPRequest):
        body, choices = await run_in_threadpool(completion, await request.body())
        return await _respond(server, body, choices, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatRequest"))
    async def chat(request: HTTPRequest):
        body, choices = await run_in_threadpool(chat_completion, await request.body())
        return await _respond(server, body, choices, request, chat=True)

    _add_tokenizer_routes(app, server, bodies)
    return app


def _add_tokenizer_routes(app: FastAPI, server: Server, bodies: BodyReader) -> None:
    """vLLM's /tokenize and /detokenize, which clients use to count and inspect prompts."""

    def model(data: Any) -> type[BaseModel]:
        chat = isinstance(data, dict) and "messages" in data
        return TokenizeChatRequest if chat else TokenizeCompletionRequest

    def tokenized(raw: bytes) -> dict:
        return server.tokenize(bodies.parse(raw, model))

    def detokenized(raw: bytes) -> dict:
        return server.detokenize(bodies.parse(raw, DetokenizeRequest))

    schemas = _body_schema("TokenizeCompletionRequest", "TokenizeChatRequest")

    @app.post("/tokenize", openapi_extra=schemas)
    async def tokenize(request: HTTPRequest) -> dict:
        return await run_in_threadpool(tokenized, await request.body())

    @app.post("/detokenize", openapi_extra=_body_schema("DetokenizeRequest"))
    async def detokenize(request: HTTPRequest) -> dict:
        return await run_in_threadpool(detokenized, await request.body())


async def _respond(
    server: Server, body: GenerationFields, choices: list[Choice], request: HTTPRequest, chat: bool
):
    started = time.perf_counter()
    prompt_tokens = sum(len(c.plan.prompt_ids) for c in choices) // body.n
    server.metrics.prompt_tokens.inc(prompt_tokens)
    head = {
        "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": server.defaults.model_name,
    }
    if body.stream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_text(index: int, delta: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, delta))

        _submit_all(server, choices, on_text)
        for c in choices:
            c.job.future.add_done_callback(
                lambda _, i=c.index: loop.call_soon_threadsafe(queue.put_nowait, (i, None))
            )
        events = _stream(server, body, choices, queue, head, chat, prompt_tokens, started)
        return StreamingResponse(events, media_type="text/event-stream")
    _submit_all(server, choices, None)
    results = await _gather(server, choices, request)
    out, completion_tokens = [], 0
    for c, result in zip(choices, results, strict=True):
        f = server.finish(result, body.return_particles)
        completion_tokens += f["tokens"]
        item: dict[str, Any] = {"index": c.index, "finish_reason": f["reason"]}
        item["logprobs"] = logprobs_view(server.llm.decode_text, result, chat, _echoed(body, c))
        if chat:
            item["message"], item["finish_reason"] = tools.reply(body, result.text, f["reason"])
        else:
            item["text"] = _echo_text(server, body, c) + result.text
        if body.prompt_logprobs is not None:
            ids = c.plan.prompt_ids
            item["prompt_logprobs"] = prompt_logprobs_view(server.llm.decode_text, ids, result)
        item["smcspec"] = f["smcspec"]
        out.append(item)
    server.metrics.latency.observe(time.perf_counter() - started)
    obj = "chat.completion" if chat else "text_completion"
    usage = _usage(prompt_tokens, completion_tokens)
    return {**head, "object": obj, "choices": out, "usage": usage, "system_fingerprint": None}


def _submit_all(server: Server, choices: list[Choice], on_text) -> None:
    """Submit every choice, or none: if one is refused the others are cancelled."""
    try:
        for c in choices:
            server.submit(c, on_text)
    except BaseException:
        for c in choices:
            if c.job is not None:
                c.job.cancel()
        raise


def _echoed(body: GenerationFields, choice: Choice) -> list[int] | None:
    """The prompt ids a completion echoes (None: no echo)."""
    echo = isinstance(body, CompletionRequest) and body.echo
    return choice.plan.prompt_ids if echo else None


def _echo_text(server: Server, body: GenerationFields, choice: Choice) -> str:
    """The prompt as the client sent it, before an echoing completion's text ("" otherwise)."""
    if _echoed(body, choice) is None:
        return ""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, str) for p in prompt):
        return prompt[choice.index // body.n]
    return server.llm.decode_text(choice.plan.prompt_ids)


def _closing(
    server: Server, body: GenerationFields, choice: Choice, chat: bool, chunk
) -> tuple[list[str], int]:
    """The last events of a finished choice (a held tool-calling reply, then the chunk with its
    finish reason; or an error event) and its token count."""
    try:
        result = _outcome(server, choice.job.future)
    except ApiError as err:
        return [_sse(error_body(err.message, err.param, err.code, err.kind))], 0
    except Exception as err:
        return [_sse(error_body(f"generation failed: {err}", kind="server_error"))], 0
    f = server.finish(result, body.return_particles)
    events, reason = [], f["reason"]
    if tools.replies_with_calls(body):
        delta, reason = tools.streamed_reply(body, result.text, reason)
        events.append(chunk(choice.index, None, delta=delta))
    # every token's log-probability comes with the last chunk, which follows the text
    logprobs = logprobs_view(server.llm.decode_text, result, chat, _echoed(body, choice))
    events.append(chunk(choice.index, None, reason, smcspec=f["smcspec"], logprobs=logprobs))
    return events, f["tokens"]


async def _stream(
    server: Server,
    body: GenerationFields,
    choices: list[Choice],
    queue: asyncio.Queue,
    head: dict,
    chat: bool,
    prompt_tokens: int,
    started: float,
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, reason: str | None = None, **extra) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            item = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            item = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
        item.update(extra)
        return _sse({**head, "object": obj, "choices": [item]})

    ended = False
    try:
        if chat:
            for c in choices:
                item = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                yield _sse({**head, "object": obj, "choices": [{**item, "finish_reason": None}]})
        for c in choices:  # an echoed prompt comes first
            if _echoed(body, c) is not None:
                yield chunk(c.index, _echo_text(server, body, c))
        open_choices = {c.index for c in choices}
        completion_tokens, first = 0, True
        hold = tools.replies_with_calls(
            body
        )  # calls are parsed from the whole reply, sent at its end
        while open_choices:
            index, delta = await queue.get()
            if delta is not None:
                if first:
                    server.metrics.first_token.observe(time.perf_counter() - started)
                    first = False
                if not hold:
                    yield chunk(index, delta)
                continue
            open_choices.discard(index)
            events, used = _closing(server, body, choices[index], chat, chunk)
            completion_tokens += used
            for event in events:
                yield event
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(prompt_tokens, completion_tokens)
            yield _sse({**head, "object": obj, "choices": [], "usage": usage})
        server.metrics.latency.observe(time.perf_counter() - started)
        yield _sse("[DONE]")
        ended = True
    finally:
        if not ended and not server.draining:  # the client left, or stopped reading
            server.metrics.count_disconnect("streaming")
        for c in choices:
            c.job.cancel()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: HTTPRequest, err: ApiError) -> JSONResponse:
        body = error_body(err.message, err.param, err.code, err.kind)
        return JSONResponse(body, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}"
            param = None
        elif first.get("type") == "extra_forbidden":
            message = f"unknown field {param!r}"
        else:
            # pydantic prefixes the message a validator raises with its exception's name
            text = first.get("msg", "invalid value").removeprefix("Value error, ")
            message = f"{param or 'body'}: {text}"
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Cancelled)
    async def cancelled(request: HTTPRequest, err: Cancelled) -> JSONResponse:
        return JSONResponse(error_body(str(err), kind="cancelled"), status_code=499)

    @app.exception_handler(ClientDisconnect)
    async def hung_up(request: HTTPRequest, err: ClientDisconnect) -> JSONResponse:
        """A client gone before its body was whole (or cut off by the read timeout): nginx's
        and vLLM's 499, one log line, no traceback; nobody is left to read the answer."""
        request.app.state.server.metrics.count_disconnect("body")
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        LOG.warning(
            "%s hung up before sending the whole body of %s %s",
            client,
            request.method,
            request.url.path,
        )
        return JSONResponse(error_body("the client hung up", kind="cancelled"), status_code=499)

    @app.exception_handler(Exception)
    async def crashed(request: HTTPRequest, err: Exception) -> JSONResponse:
        message = f"internal error: {type(err).__name__}: {err}"
        return JSONResponse(error_body(message, kind="server_error"), status_code=500)


# -- the HTTP server --------------------------------------------------------------------------


class HTTPServer(uvicorn.Server):
    """uvicorn for an app of `create_app`, with its limits. Shutdown (SIGTERM, SIGINT) is
    bounded: new connections are refused at once and new requests get a 503; running requests
    have `shutdown_timeout` seconds to finish, then their jobs are cancelled (a waiting client
    gets a 503, a stream an error event), and the process exits `CLOSE_S` later at the most."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
        self.runtime: Server = app.state.server
        d = self.runtime.defaults
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            http=h11_protocol(d.read_timeout, d.write_timeout),
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=d.shutdown_timeout + CLOSE_S,
        )
        super().__init__(config)

    async def shutdown(self, sockets=None) -> None:
        self.runtime.draining = True
        grace = self.runtime.defaults.shutdown_timeout
        cancel = asyncio.get_running_loop().call_later(grace, self.runtime.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            cancel.cancel()
            self.runtime.cancel_all()
