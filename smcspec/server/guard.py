"""What every HTTP request passes before a route sees it (pure ASGI): the API key, the body
size limit, the request count by route and status, and the count of clients that hang up."""

from __future__ import annotations

import hashlib
import hmac

import anyio
from fastapi import HTTPException
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from smcspec.server.api_error import error_body
from smcspec.server.runtime import Server

OPEN_PATHS = frozenset({"/health"})  # answered without the API key: load balancers probe it
# Set in a request's scope, to the status it got, by a connection that refused the request
# itself while the app was reading it (`connection.DeadlineProtocol`): the app then sees the
# connection end, which is no client's hang-up.
REFUSED = "smcspec.refused"


class Guard:
    """Counts requests by route and status, and clients that hang up before their response
    ended, and refuses before anything reads the body: a request without the API key (when the
    server has one) with a 401, a declared body over `max_body_bytes` with a 413. Pure ASGI:
    Starlette's BaseHTTPMiddleware would hide a client's hang-up from the handler, whose jobs
    would then run to the end."""

    def __init__(self, app: ASGIApp, server: Server) -> None:
        self.app, self.server = app, server
        key = server.defaults.api_key
        self.key_digest = None if key is None else hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500
        watch = HangUp(receive)

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                await watch.check()  # gone while its answer was being made
            watch.sending(message)
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, watch.receive, counted)
            else:
                limit = self.server.defaults.http.max_body_bytes
                await self.app(scope, _bounded(watch.receive, limit), counted)
        finally:
            route = scope.get("route")
            refused = scope.get(REFUSED)
            self.server.metrics.count_request(getattr(route, "path", "other"), refused or status)
            if watch.stage is not None and refused is None:
                self.server.metrics.count_disconnect(watch.stage)

    def _refusal(self, scope: Scope) -> Response | None:
        problem = _key_problem(scope, self.key_digest)
        if problem is not None:
            body = error_body(problem, code="invalid_api_key")
            return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        limit = self.server.defaults.http.max_body_bytes
        length = _header(scope, b"content-length") or b""
        if length.isdigit() and int(length) > limit:
            return JSONResponse(error_body(too_large(limit)), status_code=413)
        return None


class HangUp:
    """Whether, and at which stage, the client of one request hung up before its response
    ended: sending the body ("body"), while its answer was being made ("waiting"), or while it
    was being sent ("streaming"). Every layer that notices a hang-up notices it through
    `receive` (a route reading the body, a waiting request polling, a stream listening), and
    `check` asks once more as the answer starts, so a client gone by then is counted even when
    nothing had asked."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.stage: str | None = None
        self.body_whole = False
        self.started = False
        self.ended = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_whole = True
        elif message["type"] == "http.disconnect" and not self.ended and self.stage is None:
            self.stage = "streaming" if self.started else "waiting" if self.body_whole else "body"
        return message

    async def check(self) -> None:
        """Ask without waiting (a `receive` in a cancelled scope, as Starlette's
        `is_disconnected` does) whether the client is already gone."""
        with anyio.CancelScope() as scope:
            scope.cancel()
            await self.receive()

    def sending(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True  # before it goes: a server may answer later receives as gone


def _key_problem(scope: Scope, key_digest: bytes | None) -> str | None:
    """Why the request's API key is refused, or None. The tokens are compared as SHA-256
    digests with `hmac.compare_digest`: constant time, and equal lengths, so that the time
    taken tells a guesser neither the key's bytes nor its length. Neither key is ever echoed."""
    if key_digest is None or scope["path"] in OPEN_PATHS:
        return None
    given = _header(scope, b"authorization")
    if given is None:
        return "no API key given: send the header 'Authorization: Bearer <key>'"
    scheme, _, token = given.partition(b" ")
    digest = hashlib.sha256(token.strip()).digest()
    if not (hmac.compare_digest(digest, key_digest) and scheme.lower() == b"bearer"):
        return "incorrect API key provided"
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def too_large(limit: int) -> str:
    return f"the request body is over the server's limit of {limit} bytes"


def _bounded(receive: Receive, limit: int) -> Receive:
    """`receive` that counts the body as it arrives (a chunked body declares no length)."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise HTTPException(413, too_large(limit))
        return message

    return bounded
