"""The gate on Ray's own proxy paths (`server.ray_exposure.ProxyGate`), without Ray: how Serve's
proxy builds it from the environment `proxy_env` gives its controller, and what it lets through.
The same gate in a running proxy is tested in test_ray_serve_command.py."""

import asyncio
import json

import pytest

from smcspec.server.ray_exposure import proxy_env, proxy_middlewares

KEY = "sk-gate-test"


class Inner:
    """The proxy's own app: answers 200 and records the paths that reached it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def gated(monkeypatch, key: str | None):
    """The proxy's app wrapped as Serve wraps it: each middleware proxy_middlewares returns,
    built in an environment that proxy_env made."""
    for name, value in proxy_env(key).items():
        monkeypatch.setenv(name, value)
    inner = app = Inner()
    for middleware in proxy_middlewares():
        app = middleware.cls(app, *middleware.args, **middleware.kwargs)
    return inner, app


def call(app, path: str, token: str | None = None) -> tuple[int, bytes]:
    headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


@pytest.mark.parametrize("path", ["/-/routes", "/-/healthz"])
def test_rays_paths_need_the_key(monkeypatch, path):
    inner, app = gated(monkeypatch, KEY)
    for token in (None, "not-the-key", KEY + "x", KEY[:-1]):
        status, body = call(app, path, token)
        assert status == 401, token
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert call(app, path, KEY) == (200, b"ok")
    assert inner.paths == [path]


def test_other_paths_go_on_to_the_replicas_guard(monkeypatch):
    """The replica's Guard checks (and counts) them; the gate must not answer for it."""
    inner, app = gated(monkeypatch, KEY)
    for path in ("/v1/models", "/health", "/metrics"):
        assert call(app, path) == (200, b"ok")
    assert inner.paths == ["/v1/models", "/health", "/metrics"]


def test_no_key_no_gate_and_the_key_itself_stays_out_of_the_environment(monkeypatch):
    assert proxy_env(None) == {} and proxy_middlewares() == []
    inner, app = gated(monkeypatch, None)
    assert app is inner
    assert all(KEY not in value for value in proxy_env(KEY).values())
