"""The error a route raises for the client (`ApiError`, sent as OpenAI's error body with its
status), the body itself for the layers that answer before a route does, and the text check
every prompt and message passes."""

from __future__ import annotations

from typing import Any

from smcspec.server.responses import ErrorResponse


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code=None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind = kind


SHUTTING_DOWN = ApiError("the server is shutting down", status=503, kind="server_error")


def error_body(
    message: str, param: str | None = None, code: str | None = None, kind="invalid_request_error"
) -> dict[str, Any]:
    """OpenAI's error object as JSON data, for the layers that answer before a route does (the
    guard, the connection, Ray's proxy): the same `ErrorResponse` the routes send."""
    return ErrorResponse.of(message, param, code, kind).model_dump()


def check_unicode(text: str, param: str) -> None:
    """Refuse text with lone surrogates (from a JSON escape, or a byte that was not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(
            f"{param} is not valid Unicode text: a lone surrogate or an undecodable byte at "
            f"character {err.start}",
            param,
        ) from err
