"""uvicorn for an app of `server.app.create_app`, with its limits and a bounded shutdown."""

from __future__ import annotations

import asyncio
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from smcspec.server.connection import h11_protocol
from smcspec.server.runtime import Server

KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
CLOSE_S = 2.0  # after the grace period, how long cancelled requests get to send their errors
# uvicorn notices a signal at its next tick (every 0.1 s), then pauses 0.1 s before it waits for
# the running requests: both come out of the grace period, which counts from the signal.
UVICORN_PAUSE_S = 0.1


def drain_deadlines(elapsed: float, grace: float) -> tuple[float, float]:
    """Seconds from now until running requests are cancelled, and until uvicorn stops waiting
    for them to end, when the shutdown signal came `elapsed` seconds ago: `grace` and `CLOSE_S`
    count from the signal, not from whenever the server loop gets to it."""
    cancel_in = max(0.0, grace - elapsed)
    wait_for = max(0.0, grace + CLOSE_S - elapsed - UVICORN_PAUSE_S)
    return cancel_in, wait_for


class HTTPServer(uvicorn.Server):
    """uvicorn for an app of `create_app`, with its limits. Shutdown (SIGTERM, SIGINT) is
    bounded: new connections are refused at once and new requests get a 503; running requests
    have `shutdown_timeout` seconds from the signal to finish, then their jobs are cancelled (a
    waiting client gets a 503, a stream an error event), and uvicorn stops waiting for them
    `CLOSE_S` later. What is left is the scheduler's unwinding (a job stops at its next forward
    pass) and the interpreter's exit."""

    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
        self.runtime: Server = app.state.server
        self.signalled: float | None = None  # time.monotonic() of the first shutdown signal
        d = self.runtime.defaults
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            http=h11_protocol(
                d.http.read_timeout,
                d.http.write_timeout,
                d.http.max_body_bytes,
                self.runtime.metrics.count_disconnect,
            ),
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=d.http.shutdown_timeout + CLOSE_S,
        )
        super().__init__(config)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = time.monotonic()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.runtime.draining = True
        since = 0.0 if self.signalled is None else time.monotonic() - self.signalled
        cancel_in, wait_for = drain_deadlines(since, self.runtime.defaults.http.shutdown_timeout)
        self.config.timeout_graceful_shutdown = wait_for
        cancel = asyncio.get_running_loop().call_later(cancel_in, self.runtime.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            cancel.cancel()
            self.runtime.cancel_all()
