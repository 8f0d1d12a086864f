"""The guard alone, as pure ASGI (the layer that bounds a body wherever the app runs: behind
uvicorn, where the connection bounds a chunked body first, and behind Ray Serve's proxy, where
nothing else does): a body at `max_body_bytes` reaches the app, one byte more is a 413, whether
declared or counted as it arrives."""

import asyncio
from types import SimpleNamespace

import pytest
from starlette.exceptions import HTTPException

from smcspec.config import HTTPLimits
from smcspec.server.guard import Guard

LIMIT = 100


def fake_server() -> SimpleNamespace:
    metrics = SimpleNamespace(count_request=lambda route, status: None, count_disconnect=print)
    defaults = SimpleNamespace(http=HTTPLimits(max_body_bytes=LIMIT), api_key=None)
    return SimpleNamespace(defaults=defaults, metrics=metrics)


async def read_all(scope, receive, send) -> None:
    """An app that reads the whole body and answers 200 (or the status a read raised)."""
    status = 200
    try:
        while True:
            message = await receive()
            if not message.get("more_body", False):
                break
    except HTTPException as err:
        status = err.status_code
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def status_of(size: int, declare: bool) -> int:
    """The status the guarded app answers a body of `size` bytes sent in pieces of 30, its
    length declared in a content-length header or not (chunked)."""
    pieces = [b"x" * min(30, size - i) for i in range(0, size, 30)]
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    headers = [(b"content-length", str(size).encode())] if declare else []
    scope = {"type": "http", "path": "/tokenize", "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(Guard(read_all, fake_server())(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("size", "status"), [(LIMIT, 200), (LIMIT + 1, 413)], ids=["at", "past"])
def test_a_body_at_the_limit_passes_and_one_byte_more_is_413(declare, size, status):
    """Failed on: `int(length) >= limit` (content-length, at), `seen >= limit` (chunked, at),
    `seen > limit + 1` (chunked, past)."""
    assert status_of(size, declare) == status
