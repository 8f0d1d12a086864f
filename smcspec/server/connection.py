"""One HTTP connection: uvicorn's h11 protocol with the limits uvicorn lacks. A request's head
must stay within `MAX_HEADER_BYTES` and `MAX_HEADERS` (431), however it arrives; its head and
body must arrive within the read timeout; and a response the client stops reading is dropped
after the write timeout."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from smcspec.server.runtime import error_body

MAX_HEADER_BYTES = 16 * 1024  # a request's target and headers
MAX_HEADERS = 100


class CappedConnection(h11.Connection):
    """h11's server side, holding a head that arrives whole to the cap it puts only on one still
    incomplete (so one write of a 60 KB header passed), and keeping the status its last protocol
    error hints (431 for a head too large) for the answer."""

    def __init__(self) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.status_hint = 400

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.status_hint = err.error_status_hint
            raise
        if isinstance(event, h11.Request) and _over_cap(event):
            self.status_hint = 431
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


def _over_cap(request: h11.Request) -> bool:
    size = len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
    return size > MAX_HEADER_BYTES or len(request.headers) > MAX_HEADERS


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading a request (its head and body must arrive
    within `read_timeout` seconds of the connection opening or of the request's first byte) and
    on writing a response (a client that reads none of it for `write_timeout` seconds, once the
    socket buffers are full, is dropped). uvicorn has neither: a client sending a byte now and
    then, or never reading its stream, would hold the connection and its buffers for good.

    uvicorn builds the protocol itself from a class, so the deadlines are a subclass's own
    (`h11_protocol`), not constructor arguments."""

    read_timeout: float
    write_timeout: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = CappedConnection()
        self.write_deadline: Any = None

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

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self.read_deadline, self.write_deadline):
            if deadline is not None:
                deadline.cancel()
        super().connection_lost(exc)

    def read_timed_out(self) -> None:
        self.read_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
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
        if self.conn.status_hint != 431:
            return super().send_400_response(msg)
        message = f"the request's head is over the server's limit of {MAX_HEADER_BYTES} "
        message += f"bytes or {MAX_HEADERS} headers"
        body = json.dumps(error_body(message)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        reason = HTTPStatus(431).phrase.encode()
        response = h11.Response(status_code=431, headers=headers, reason=reason)
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def h11_protocol(read_timeout: float, write_timeout: float) -> type[H11Protocol]:
    """`DeadlineProtocol` with these deadlines (seconds), for uvicorn's `http`."""
    deadlines = {"read_timeout": read_timeout, "write_timeout": write_timeout}
    return type("Deadlines", (DeadlineProtocol,), deadlines)
