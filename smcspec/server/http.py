"""uvicorn for an app of `server.app.create_app`, with its limits and a bounded shutdown."""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI

from smcspec.server.connection import h11_protocol
from smcspec.server.runtime import Server

KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
CLOSE_S = 2.0  # after the grace period, how long cancelled requests get to send their errors


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

    async def shutdown(self, sockets=None) -> None:
        self.runtime.draining = True
        grace = self.runtime.defaults.http.shutdown_timeout
        cancel = asyncio.get_running_loop().call_later(grace, self.runtime.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            cancel.cancel()
            self.runtime.cancel_all()
