"""The OpenAI-compatible HTTP server.

    app = create_app(llm, ServeDefaults(model_name="my-model"))
    HTTPServer(app, "127.0.0.1", 8000).run()

Every choice of every request is one scheduler job (see `engine.scheduler`), so concurrent
requests share forward passes, each with its own method and settings. Streaming sends the text
that can no longer change: committed tokens for ar and sd, the particles' common prefix for smc,
and the rest once the final particle is drawn (`streaming`).

Parsing, templating, tokenizing and planning run in worker threads, and `bodies` bounds the
work of decoding a body before it starts, so a large body never holds up the event loop; bodies
over `max_body_bytes`, and requests without the server's API key (when it has one), are refused
before anything reads them; `connection` caps request heads and times reads and writes. Every
answer is a model of `responses`; `errors` turns failures into OpenAI's error body.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from smcspec.engine import LLM
from smcspec.engine.loading import public_name
from smcspec.server import shaping, streaming
from smcspec.server.bodies import BodyReader
from smcspec.server.cluster import ReplicaView
from smcspec.server.errors import add_error_handlers
from smcspec.server.guard import Guard
from smcspec.server.http import HTTPServer
from smcspec.server.jobs import gather, submit_all
from smcspec.server.responses import (
    ChatCompletion,
    Completion,
    Detokenized,
    ErrorResponse,
    Head,
    Health,
    Limits,
    ModelCard,
    ModelList,
    Tokenized,
)
from smcspec.server.runtime import Choice, ServeDefaults, Server
from smcspec.server.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

__all__ = ["HTTPServer", "ServeDefaults", "create_app"]

BODIES = (
    CompletionRequest,
    ChatRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
# The error body of every refused request, for the OpenAPI schema.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 499, 500, 503)
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
    add_error_handlers(app)
    _with_body_schemas(app)
    _add_status_routes(app, server, view)
    _add_generation_routes(app, server, bodies)
    _add_tokenizer_routes(app, server, bodies)
    return app


def _add_status_routes(app: FastAPI, server: Server, view: ReplicaView | None) -> None:
    """/health, /metrics and /v1/models."""

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Response:
        replicas = {} if view is None else await run_in_threadpool(view.health)
        report = _health(server, replicas)
        status = 200 if report.scheduler_alive else 503
        return JSONResponse(report.model_dump(), status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.render() if view is None else await run_in_threadpool(view.render)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        name = server.defaults.model_name
        card = ModelCard(id=name, created=server.created, owned_by="smcspec")
        return JSONResponse(ModelList(data=[card]).model_dump())


def _health(server: Server, replicas: dict[str, Any]) -> Health:
    """What /health reports: the models, whether the scheduler's thread is alive, the limits
    the server runs within (with `replicas`, what `ReplicaView.health` adds)."""
    s, llm = server.scheduler, server.llm
    alive = s.alive
    return Health(
        status="ok" if alive else "degraded",
        model=server.defaults.model_name,
        target=public_name(llm.names[0]),
        draft=public_name(llm.names[1]),
        backend=llm.backend,
        dtype=llm.dtype,
        scheduler_alive=alive,
        running=s.running,
        queued=s.queued,
        limits=Limits(**server.limits()),
        **replicas,
    )


def _add_generation_routes(app: FastAPI, server: Server, bodies: BodyReader) -> None:
    """/v1/completions and /v1/chat/completions: a JSON response, or server-sent events."""

    def completion(raw: bytes) -> tuple[GenerationFields, list[Choice]]:
        body = bodies.parse(raw, CompletionRequest)
        server.check_model(body.model)
        return body, server.plan(body, server.completion_prompts(body), "prompt")

    def chat_completion(raw: bytes) -> tuple[GenerationFields, list[Choice]]:
        body = bodies.parse(raw, ChatRequest)
        server.check_model(body.model)
        return body, server.plan(body, server.chat_prompt(body), "messages")

    @app.post(
        "/v1/completions",
        openapi_extra=_body_schema("CompletionRequest"),
        response_model=Completion,
        responses=ERRORS,
    )
    async def completions(request: HTTPRequest) -> Response:
        body, choices = await run_in_threadpool(completion, await request.body())
        return await _respond(server, body, choices, request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_body_schema("ChatRequest"),
        response_model=ChatCompletion,
        responses=ERRORS,
    )
    async def chat(request: HTTPRequest) -> Response:
        body, choices = await run_in_threadpool(chat_completion, await request.body())
        return await _respond(server, body, choices, request)


async def _respond(
    server: Server, body: GenerationFields, choices: list[Choice], request: HTTPRequest
) -> Response:
    started = time.perf_counter()
    prompt_tokens = sum(len(c.plan.prompt_ids) for c in choices) // body.n
    server.metrics.prompt_tokens.inc(prompt_tokens)
    head = Head.new(isinstance(body, ChatRequest), server.defaults.model_name)
    if body.stream:
        return streaming.response(server, body, choices, head, prompt_tokens, started)
    submit_all(server, choices, None)
    results = await gather(server, choices, request)
    whole = shaping.whole(server, body, choices, results, head, prompt_tokens)
    server.metrics.latency.observe(time.perf_counter() - started)
    return JSONResponse(whole.model_dump())


def _add_tokenizer_routes(app: FastAPI, server: Server, bodies: BodyReader) -> None:
    """vLLM's /tokenize and /detokenize, which clients use to count and inspect prompts."""

    def model(data: Any) -> type[BaseModel]:
        chat = isinstance(data, dict) and "messages" in data
        return TokenizeChatRequest if chat else TokenizeCompletionRequest

    def tokenized(raw: bytes) -> Tokenized:
        return Tokenized.model_validate(server.tokenize(bodies.parse(raw, model)))

    def detokenized(raw: bytes) -> Detokenized:
        return Detokenized.model_validate(server.detokenize(bodies.parse(raw, DetokenizeRequest)))

    @app.post(
        "/tokenize",
        openapi_extra=_body_schema("TokenizeCompletionRequest", "TokenizeChatRequest"),
        response_model=Tokenized,
        responses=ERRORS,
    )
    async def tokenize(request: HTTPRequest) -> Response:
        out = await run_in_threadpool(tokenized, await request.body())
        return JSONResponse(out.model_dump())

    @app.post(
        "/detokenize",
        openapi_extra=_body_schema("DetokenizeRequest"),
        response_model=Detokenized,
        responses=ERRORS,
    )
    async def detokenize(request: HTTPRequest) -> Response:
        out = await run_in_threadpool(detokenized, await request.body())
        return JSONResponse(out.model_dump())


# -- OpenAPI ------------------------------------------------------------------------------------


def _body_schema(*names: str) -> dict:
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


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
