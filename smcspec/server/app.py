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
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from smcspec.config import METHODS
from smcspec.engine import LLM, GenerationResult, Request
from smcspec.engine.scheduler import Cancelled, Job, Scheduler
from smcspec.server.metrics import ServerMetrics
from smcspec.server.schema import ChatRequest, CompletionRequest, GenerationFields
from smcspec.server.text import TextStream

POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class ServeDefaults:
    """Server-wide settings; each request may override the decoding ones."""

    model_name: str
    method: str = "smc"
    particles: int = 8
    draft_tokens: int = 4
    resample_threshold: float = 0.5
    resampling: str = "systematic"
    temperature: float = 1.0
    max_tokens: int = 128
    max_running: int = 64
    max_batch_tokens: int = 256

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Choice:
    """One sample being generated: its checked request, its text stream and its job."""

    index: int
    plan: Request
    text: TextStream
    job: Job | None = None


class Server:
    """The runtime behind the app: the LLM, the scheduler, the metrics."""

    def __init__(self, llm: LLM, defaults: ServeDefaults) -> None:
        self.llm = llm
        self.defaults = defaults
        self.scheduler = Scheduler(
            (llm.target, llm.draft), defaults.max_running, defaults.max_batch_tokens
        )
        self.metrics = ServerMetrics(self.scheduler)
        self.context_length = getattr(llm.target, "context_length", None)
        self.created = int(time.time())

    # -- requests -> plans ------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.defaults.model_name:
            raise ApiError(
                f"unknown model {model!r}: this server serves {self.defaults.model_name!r}",
                "model",
                code="model_not_found",
            )

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.llm.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(f"prompt token ids must lie in [0, {vocab})", "prompt")
            return [list(prompt)]
        texts = [prompt] if isinstance(prompt, str) else prompt
        try:
            return [self.llm.encode(t, chat=False) for t in texts]
        except ValueError as err:
            raise ApiError(str(err), "prompt") from err

    def chat_prompt(self, body: ChatRequest) -> list[list[int]]:
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            return [self.llm.encode_messages(messages)]
        except ValueError as err:
            raise ApiError(str(err), "messages") from err

    def plan(self, body: GenerationFields, prompts: list[list[int]], param: str) -> list[Choice]:
        """One checked `Request` per (prompt, sample), with its own seed."""
        d = self.defaults
        method = body.method or d.method
        k = body.draft_tokens or d.draft_tokens
        choices = []
        for p, ids in enumerate(prompts):
            limit = self._token_limit(body, len(ids), 0 if method == "ar" else k, param)
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + j
                try:
                    plan = self.llm.plan(
                        ids,
                        method,
                        particles=body.particles or d.particles,
                        draft_tokens=k,
                        resample_threshold=_given(body.resample_threshold, d.resample_threshold),
                        resampling=body.resampling or d.resampling,
                        temperature=_given(body.temperature, d.temperature),
                        draft_temperature=body.draft_temperature,
                        top_k=body.top_k or 0,
                        top_p=_given(body.top_p, 1.0),
                        max_new_tokens=limit,
                        stop_at_eos=not body.ignore_eos,
                        seed=seed,
                        chat=False,
                        power_alpha=body.power_alpha,
                        json_schema=_schema(body),
                    )
                except ValueError as err:
                    raise ApiError(str(err)) from err
                stream = TextStream(self.llm.decode_text, body.stops)
                choices.append(Choice(len(choices), plan, stream))
        return choices

    def _token_limit(self, body: GenerationFields, prompt_len: int, lookahead: int, param: str):
        """max_tokens as asked, or the server default cut to the room the context leaves."""
        limit = body.token_limit
        ctx = self.context_length
        if ctx is None:
            return limit or self.defaults.max_tokens
        room = ctx - prompt_len - lookahead
        if room < 1:
            raise ApiError(
                f"the prompt has {prompt_len} tokens and the model's context holds {ctx}", param
            )
        if limit is None:
            return min(self.defaults.max_tokens, room)
        if limit > room:
            raise ApiError(
                f"max_tokens {limit} plus the prompt's {prompt_len} tokens (and {lookahead} "
                f"draft tokens of lookahead) exceed the model's context of {ctx}",
                "max_tokens",
            )
        return limit

    # -- running ----------------------------------------------------------------------------

    def submit(self, choice: Choice, on_text: Callable[[int, str], None] | None = None) -> Job:
        plan, text = choice.plan, choice.text

        def watch(tokens: list[int]) -> bool:
            delta = text.update(tokens)
            if delta and on_text is not None:
                on_text(choice.index, delta)
            return text.stopped

        pages = self.scheduler.pages_for(plan.kv_rows(), plan.max_length())
        try:
            choice.job = self.scheduler.submit(
                Job(lambda views: self.llm.run(plan, views, watch), pages)
            )
        except ValueError as err:
            raise ApiError(str(err)) from err
        return choice.job

    def finish(self, choice: Choice, result: GenerationResult, particles: bool) -> dict:
        """The rest of the text, the finish reason and the diagnostics of a finished choice."""
        rest = choice.text.finish(result.token_ids)
        tokens = result.token_ids
        ended = bool(tokens) and tokens[-1] in self.llm.target.eos_token_ids
        cut = choice.plan.sampling.stop_at_eos and ended
        if choice.text.stopped or cut or len(tokens) < choice.plan.sampling.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        used = choice.text.tokens_used
        self.metrics.record_choice(result.method, used, result.diagnostics)
        extra: dict[str, Any] = {"method": result.method, "diagnostics": result.diagnostics}
        if particles and result.particle_texts is not None:
            weights = result.diagnostics.get("weights", [])
            extra["particles"] = [
                {"text": t, "weight": w}
                for t, w in zip(result.particle_texts, weights, strict=True)
            ]
        return {"rest": rest, "reason": reason, "tokens": used, "smcspec": _finite(extra)}

    async def gather(self, choices: list[Choice], request: HTTPRequest) -> list[GenerationResult]:
        """Wait for every choice's job; cancel them all if the client goes away."""
        futures = [asyncio.wrap_future(c.job.future) for c in choices]
        try:
            while True:
                _, pending = await asyncio.wait(futures, timeout=POLL_S)
                if not pending:
                    break
                if await request.is_disconnected():
                    raise Cancelled("the client went away")
            return [_result(f) for f in futures]
        finally:
            for c in choices:
                c.job.cancel()

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def _result(future) -> GenerationResult:
    """The result of a finished job's future (asyncio or concurrent), bad input as ApiError."""
    err = future.exception()
    if err is None:
        return future.result()
    if isinstance(err, ValueError):
        raise ApiError(str(err)) from err
    raise err


def _given(value, default):
    return default if value is None else value


def _schema(body: GenerationFields) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    return json.dumps(fmt.json_schema.schema_)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


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
    _add_error_handlers(app, server)

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
    results = await server.gather(choices, request)
    out, completion_tokens = [], 0
    for c, result in zip(choices, results, strict=True):
        f = server.finish(c, result, body.return_particles)
        completion_tokens += f["tokens"]
        text = c.text.sent
        item: dict[str, Any] = {"index": c.index, "finish_reason": f["reason"], "logprobs": None}
        if chat:
            item["message"] = {"role": "assistant", "content": text}
        else:
            item["text"] = text
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
                result = _result(c.job.future)
            except ApiError as err:
                yield _sse(_error_body(err.message, err.param))
                continue
            except Exception as err:
                yield _sse(_error_body(f"generation failed: {err}", kind="server_error"))
                continue
            f = server.finish(c, result, body.return_particles)
            completion_tokens += f["tokens"]
            if f["rest"] and first:
                server.metrics.first_token.observe(time.perf_counter() - started)
                first = False
            yield chunk(index, f["rest"] or None, f["reason"], smcspec=f["smcspec"])
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


def _add_error_handlers(app: FastAPI, server: Server) -> None:
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
