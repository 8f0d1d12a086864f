"""The OpenAI-compatible HTTP server.

    app = create_app(llm, ServeDefaults(model_name="my-model"))

Every choice of every request is one scheduler job (see `engine.scheduler`), so concurrent
requests share forward passes, each with its own method and settings. Streaming sends the text
that can no longer change: committed tokens for ar and sd, the particles' common prefix for smc,
and the rest once the final particle is drawn.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from smcspec.engine import LLM, GenerationResult
from smcspec.engine.scheduler import Cancelled
from smcspec.server.runtime import ApiError, Choice, ServeDefaults, Server, result_of
from smcspec.server.schema import ChatRequest, CompletionRequest, GenerationFields

__all__ = ["ServeDefaults", "create_app"]

POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


async def _gather(choices: list[Choice], request: HTTPRequest) -> list[GenerationResult]:
    """Wait for every choice's job; cancel them all if the client goes away."""
    futures = [asyncio.wrap_future(c.job.future) for c in choices]
    try:
        while True:
            _, pending = await asyncio.wait(futures, timeout=POLL_S)
            if not pending:
                break
            if await request.is_disconnected():
                raise Cancelled("the client went away")
        return [result_of(f) for f in futures]
    finally:
        for c in choices:
            c.job.cancel()


def _error_body(message: str, param: str | None = None, code=None, kind="invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


# -- the app ----------------------------------------------------------------------------------


def create_app(llm: LLM, defaults: ServeDefaults) -> FastAPI:
    server = Server(llm, defaults)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.shutdown()

    app = FastAPI(title="smcspec", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        server.metrics.count_request(getattr(route, "path", "other"), response.status_code)
        return response

    @app.get("/health")
    async def health() -> dict:
        s = server.scheduler
        return {
            "status": "ok",
            "model": defaults.model_name,
            "target": llm.names[0],
            "draft": llm.names[1],
            "backend": llm.backend,
            "dtype": llm.dtype,
            "running": s.running,
            "queued": s.queued,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": defaults.model_name, "object": "model", "created": server.created}
        return {"object": "list", "data": [{**card, "owned_by": "smcspec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        server.check_model(body.model)
        choices = server.plan(body, server.completion_prompts(body), "prompt")
        return await _respond(server, body, choices, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        server.check_model(body.model)
        choices = server.plan(body, server.chat_prompt(body), "messages")
        return await _respond(server, body, choices, request, chat=True)

    return app


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
    results = await _gather(choices, request)
    out, completion_tokens = [], 0
    for c, result in zip(choices, results, strict=True):
        f = server.finish(result, body.return_particles)
        completion_tokens += f["tokens"]
        item: dict[str, Any] = {"index": c.index, "finish_reason": f["reason"], "logprobs": None}
        if chat:
            item["message"] = {"role": "assistant", "content": result.text}
        else:
            item["text"] = result.text
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

    try:
        if chat:
            for c in choices:
                item = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                yield _sse({**head, "object": obj, "choices": [{**item, "finish_reason": None}]})
        open_choices = {c.index for c in choices}
        completion_tokens, first = 0, True
        while open_choices:
            index, delta = await queue.get()
            if delta is not None:
                if first:
                    server.metrics.first_token.observe(time.perf_counter() - started)
                    first = False
                yield chunk(index, delta)
                continue
            open_choices.discard(index)
            c = choices[index]
            try:
                result = result_of(c.job.future)
            except ApiError as err:
                yield _sse(_error_body(err.message, err.param))
                continue
            except Exception as err:
                yield _sse(_error_body(f"generation failed: {err}", kind="server_error"))
                continue
            f = server.finish(result, body.return_particles)
            completion_tokens += f["tokens"]
            yield chunk(index, None, f["reason"], smcspec=f["smcspec"])
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(prompt_tokens, completion_tokens)
            yield _sse({**head, "object": obj, "choices": [], "usage": usage})
        server.metrics.latency.observe(time.perf_counter() - started)
        yield _sse("[DONE]")
    finally:
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
        return JSONResponse(_error_body(err.message, err.param, err.code), status_code=err.status)

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
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(_error_body(message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, err: HTTPException) -> JSONResponse:
        return JSONResponse(_error_body(str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Cancelled)
    async def cancelled(request: HTTPRequest, err: Cancelled) -> JSONResponse:
        return JSONResponse(_error_body(str(err), kind="cancelled"), status_code=499)

    @app.exception_handler(Exception)
    async def crashed(request: HTTPRequest, err: Exception) -> JSONResponse:
        message = f"internal error: {type(err).__name__}: {err}"
        return JSONResponse(_error_body(message, kind="server_error"), status_code=500)
