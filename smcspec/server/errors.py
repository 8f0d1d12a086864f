"""Every failure a route can meet, as OpenAI's error body (`responses.ErrorResponse`) with its
status: a refused request 400, a cancelled one 499 (nginx's and vLLM's code for a client that
left), anything unforeseen 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from smcspec.engine.job import Cancelled
from smcspec.server.api_error import ApiError
from smcspec.server.guard import REFUSED
from smcspec.server.responses import ErrorResponse

LOG = logging.getLogger("smcspec.server")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
) -> JSONResponse:
    body = ErrorResponse.of(message, param, code, kind)
    return JSONResponse(body.model_dump(), status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: HTTPRequest, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.code, err.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        message, param = _invalid(err)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Cancelled)
    async def cancelled(request: HTTPRequest, err: Cancelled) -> JSONResponse:
        return error_response(499, str(err), kind="cancelled")

    @app.exception_handler(ClientDisconnect)
    async def hung_up(request: HTTPRequest, err: ClientDisconnect) -> JSONResponse:
        """A client gone before its body was whole (or cut off by the read timeout): nginx's
        and vLLM's 499, one log line, no traceback; nobody is left to read the answer. The
        guard counts it. A connection that refused the request itself (`guard.REFUSED`) has
        answered it already."""
        if REFUSED in request.scope:
            return error_response(request.scope[REFUSED], "refused by the connection")
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        LOG.warning(
            "%s hung up before sending the whole body of %s %s",
            client,
            request.method,
            request.url.path,
        )
        return error_response(499, "the client hung up", kind="cancelled")

    @app.exception_handler(Exception)
    async def crashed(request: HTTPRequest, err: Exception) -> JSONResponse:
        message = f"internal error: {type(err).__name__}: {err}"
        return error_response(500, message, kind="server_error")


def _invalid(err: RequestValidationError) -> tuple[str, str | None]:
    """The message and field of a body pydantic refused, from its first error."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    # pydantic prefixes the message a validator raises with its exception's name
    text = first.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{param or 'body'}: {text}", param
