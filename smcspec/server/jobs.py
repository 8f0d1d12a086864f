"""A request's scheduler jobs seen from the event loop: submitted all or none, awaited while
the client is still there, and their outcomes read as results or the errors a client gets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from fastapi import Request as HTTPRequest

from smcspec.engine import GenerationResult
from smcspec.engine.job import Cancelled
from smcspec.server.api_error import ApiError
from smcspec.server.runtime import Choice, Server

POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


def submit_all(
    server: Server, choices: list[Choice], on_text: Callable[[int, str], None] | None
) -> None:
    """Submit every choice, or none: if one is refused the others are cancelled."""
    try:
        for c in choices:
            server.submit(c, on_text)
    except BaseException:
        for c in choices:
            if c.job is not None:
                c.job.cancel()
        raise


async def gather(
    server: Server, choices: list[Choice], request: HTTPRequest
) -> list[GenerationResult]:
    """Wait for every choice's job; cancel them all if the client goes away."""
    futures = [asyncio.wrap_future(c.job.future) for c in choices]
    for future in futures:
        future.add_done_callback(_retrieved)
    try:
        while True:
            _, pending = await asyncio.wait(futures, timeout=POLL_S)
            if not pending:
                break
            if await request.is_disconnected():  # counted by the guard, which saw it
                raise Cancelled("the client went away")
        return [outcome(server, f) for f in futures]
    finally:
        for c in choices:
            c.job.cancel()


def _retrieved(future: asyncio.Future) -> None:
    """Mark a job's outcome as seen: a cancelled job's exception would otherwise be logged with
    its traceback when the future is collected ("exception was never retrieved"), and Python
    3.11 formats tracebacks with `ast`, which is not safe beside another thread's `ast` use."""
    if not future.cancelled():
        future.exception()


def outcome(server: Server, future: asyncio.Future | Future) -> GenerationResult:
    """A finished job's result; a job the server cancelled (shutting down) as its error."""
    try:
        return result_of(future)
    except Cancelled as err:
        raise server.failure(err) or err from err


def result_of(future: asyncio.Future | Future) -> GenerationResult:
    """The result of a finished job's future (asyncio or concurrent), bad input as ApiError:
    a 400, as is a decode that could not satisfy its response_format or tools (a
    `ConstraintError`); a stream, whose head has gone, gets it as an error event before
    [DONE]."""
    if future.cancelled():  # a job cancelled while still queued
        raise Cancelled("the request was cancelled")
    err = future.exception()
    if err is None:
        return future.result()
    if isinstance(err, ValueError):
        raise ApiError(str(err)) from err
    raise err
