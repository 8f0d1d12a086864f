"""The drain deadlines of a shutdown, without a wall clock: the grace period and CLOSE_S count
from the signal, not from when uvicorn's loop gets to it (up to 0.1 s later) nor from after its
own 0.1 s pause. (tests/server/test_serve_command.py sends a real SIGTERM and bounds the exit
with generous slack.)"""

import asyncio
import time
from types import SimpleNamespace

import pytest
import uvicorn

from smcspec.config import HTTPLimits
from smcspec.server.http import CLOSE_S, UVICORN_PAUSE_S, HTTPServer, drain_deadlines


@pytest.mark.parametrize(
    ("elapsed", "grace", "cancel_in", "wait_for"),
    [
        (0.0, 5.0, 5.0, 5.0 + CLOSE_S - UVICORN_PAUSE_S),
        (0.3, 5.0, 4.7, 5.0 + CLOSE_S - UVICORN_PAUSE_S - 0.3),
        (0.0, 0.0, 0.0, CLOSE_S - UVICORN_PAUSE_S),
        (9.0, 5.0, 0.0, 0.0),  # a loop that got to the signal late cancels at once
    ],
)
def test_the_deadlines_count_from_the_signal(elapsed, grace, cancel_in, wait_for):
    """Failed on: the grace counted from shutdown() (5.0 s to the cancel 0.3 s after the
    signal) and uvicorn's wait set to grace + CLOSE_S from after its pause (0.1 s more)."""
    assert drain_deadlines(elapsed, grace) == pytest.approx((cancel_in, wait_for))


def test_shutdown_waits_for_what_is_left_of_the_bound_since_the_signal(monkeypatch):
    """A signal 1 s before shutdown() runs leaves uvicorn grace + CLOSE_S - 1 - its pause to
    wait, and cancels the running jobs when shutdown ends, whatever uvicorn did. Failed on:
    uvicorn's wait left at grace + CLOSE_S (7 s)."""
    cancelled = []
    runtime = SimpleNamespace(
        defaults=SimpleNamespace(http=HTTPLimits(shutdown_timeout=5.0)),
        metrics=SimpleNamespace(count_disconnect=lambda stage: None),
        draining=False,
        cancel_all=lambda: cancelled.append(True),
    )
    server = HTTPServer(SimpleNamespace(state=SimpleNamespace(server=runtime)), "127.0.0.1", 0)
    waited = []

    async def uvicorn_shutdown(self, sockets=None) -> None:
        waited.append(self.config.timeout_graceful_shutdown)

    monkeypatch.setattr(uvicorn.Server, "shutdown", uvicorn_shutdown)
    server.signalled = time.monotonic() - 1.0
    asyncio.run(server.shutdown())
    assert runtime.draining and cancelled == [True]
    assert waited == [pytest.approx(5.0 + CLOSE_S - 1.0 - UVICORN_PAUSE_S, abs=0.05)]


def test_only_the_first_signal_starts_the_clock(monkeypatch):
    runtime = SimpleNamespace(
        defaults=SimpleNamespace(http=HTTPLimits()),
        metrics=SimpleNamespace(count_disconnect=lambda stage: None),
    )
    server = HTTPServer(SimpleNamespace(state=SimpleNamespace(server=runtime)), "127.0.0.1", 0)
    monkeypatch.setattr(uvicorn.Server, "handle_exit", lambda self, sig, frame: None)
    server.handle_exit(15, None)
    first = server.signalled
    server.handle_exit(2, None)
    assert first is not None and server.signalled == first
