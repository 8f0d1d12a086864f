"""One HTTP connection: uvicorn's h11 protocol with the limits and the strictness uvicorn lacks.
A request's head must stay within `MAX_HEADER_BYTES` and `MAX_HEADERS` (431), however it
arrives, and may not fold a header over lines (400: RFC 9112 section 5.2 lets a server refuse
obs-fold, and a folded `Transfer-Encoding` is how requests are smuggled past proxies that read it
otherwise); a chunked body whose chunk sizes add up past the body limit is refused (413) as soon
as the size line arrives, instead of waiting for bytes that would be refused anyway; its head and
body must arrive within the read timeout; and a response the client stops reading is dropped
after the write timeout. Lines may end in a bare LF, as RFC 9112 section 2.2 allows a recipient
to accept (h11 does); a chunk's size line must end in CRLF (h11 requires it). A client that hangs
up halfway through a head is counted as a disconnect at stage "head" (the app never sees it)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from smcspec.server.api_error import error_body
from smcspec.server.guard import REFUSED, too_large

MAX_HEADER_BYTES = 16 * 1024  # a request's target and headers
MAX_HEADERS = 100
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_FOLD = re.compile(rb"\n[ \t]")  # a line that starts with white space continues the one before


class StrictConnection(h11.Connection):
    """h11's server side, made strict where h11 is lenient: it holds a head that arrives whole
    to the cap it puts only on one still incomplete (so one write of a 60 KB header passed), it
    refuses folded header lines (h11 joins them), and it refuses a chunked body as soon as its
    declared chunk sizes pass `max_body_bytes` (h11 waits for the bytes of a chunk of 2^80). The
    status its last protocol error hints (431, 413, 400) and why are kept for the answer."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.max_body_bytes = max_body_bytes
        self.status_hint = 400
        self.problem = "malformed HTTP request"
        self.received = 0  # the body's bytes read so far

    def next_event(self) -> Any:
        head = self.trailing_data[0] if self.their_state is h11.IDLE else b""
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            raise self._refuse(err.error_status_hint, f"malformed HTTP request: {err}") from err
        if isinstance(event, h11.Request):
            self.received = 0
            if _over_cap(event):
                raise self._refuse(431, _head_message())
            if _folded(head):
                raise self._refuse(400, "a header is folded over several lines (obs-fold)")
        if self.their_state is h11.SEND_BODY:
            self.received += len(event.data) if isinstance(event, h11.Data) else 0
            # h11 keeps what is left of the chunk whose size line it read last (0 otherwise)
            left = getattr(self._reader, "_bytes_in_chunk", 0)
            if self.received + left > self.max_body_bytes:
                raise self._refuse(413, too_large(self.max_body_bytes))
        return event

    def _refuse(self, status: int, problem: str) -> h11.RemoteProtocolError:
        self.status_hint, self.problem = status, problem[:200]
        return h11.RemoteProtocolError(problem, error_status_hint=status)


def _over_cap(request: h11.Request) -> bool:
    size = len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
    return size > MAX_HEADER_BYTES or len(request.headers) > MAX_HEADERS


def _folded(buffered: bytes) -> bool:
    """Whether the head at the start of `buffered` has a line that continues the one before."""
    end = _HEAD_END.search(buffered)
    head = buffered[: end.start() + 1] if end else buffered
    return _FOLD.search(head) is not None


def _head_message() -> str:
    return (
        f"the request's head is over the server's limit of {MAX_HEADER_BYTES} bytes or "
        f"{MAX_HEADERS} headers"
    )


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading a request (its head and body must arrive
    within `read_timeout` seconds of the connection opening or of the request's first byte) and
    on writing a response (a client that reads none of it for `write_timeout` seconds, once the
    socket buffers are full, is dropped), strict framing (`StrictConnection`), and the count of
    clients that hang up before their head is whole. uvicorn has neither deadline: a client
    sending a byte now and then, or never reading its stream, would hold the connection and its
    buffers for good.

    uvicorn builds the protocol itself from a class, so the settings are a subclass's own
    (`h11_protocol`), not constructor arguments."""

    read_timeout: float
    write_timeout: float
    max_body_bytes: int
    on_hang_up: Callable[[str], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection(self.max_body_bytes)
        self.write_deadline: Any = None
        self.peer_closed = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.read_deadline = self.loop.call_later(self.read_timeout, self.read_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if not reading and self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None
        elif reading and self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.read_timeout, self.read_timed_out)

    def eof_received(self) -> None:
        self.peer_closed = True
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self.read_deadline, self.write_deadline):
            if deadline is not None:
                deadline.cancel()
        if (self.peer_closed or exc is not None) and self._mid_head():
            self.on_hang_up("head")
        super().connection_lost(exc)

    def _mid_head(self) -> bool:
        """Whether part of a request's head has arrived and none of it reached the app."""
        between = self.cycle is None or self.cycle.response_complete
        return between and self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def read_timed_out(self) -> None:
        self.read_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if self._mid_head():
                self.on_hang_up("head")  # as a stall mid-body counts at "body"
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_deadline is None:
            self.write_deadline = self.loop.call_later(self.write_timeout, self.write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_deadline is not None:
            self.write_deadline.cancel()
            self.write_deadline = None

    def write_timed_out(self) -> None:
        """`abort`, not `close`: close would wait for the client to read what is buffered."""
        self.write_deadline = None
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        """The refusal of a request h11 or `StrictConnection` could not accept, as OpenAI's
        error body with the status its error hints; an app already reading the body is told
        that the connection, not the client, ended it (`guard.REFUSED`)."""
        status, problem = self.conn.status_hint, self.conn.problem
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope[REFUSED] = status  # type: ignore[literal-required]
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()  # the app's response has begun: too late for another
            return
        body = json.dumps(error_body(problem)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        reason = HTTPStatus(status).phrase.encode()
        response = h11.Response(status_code=status, headers=headers, reason=reason)
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def h11_protocol(
    read_timeout: float,
    write_timeout: float,
    max_body_bytes: int,
    on_hang_up: Callable[[str], None],
) -> type[H11Protocol]:
    """`DeadlineProtocol` with these deadlines (seconds), this body limit and this count of
    hang-ups by stage, for uvicorn's `http`."""
    settings = {
        "read_timeout": read_timeout,
        "write_timeout": write_timeout,
        "max_body_bytes": max_body_bytes,
        "on_hang_up": staticmethod(on_hang_up),
    }
    return type("Deadlines", (DeadlineProtocol,), settings)
