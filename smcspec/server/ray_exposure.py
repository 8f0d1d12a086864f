"""What of Ray listens where, and what asks for the API key, when the server runs as replicas
(`server.ray_app`).

A Ray instance that `smcspec serve --replicas` starts listens on loopback only, whatever
`--host` is: its GCS, raylet, agents, workers and Prometheus exporters (which give the node's
address, session and timings to whoever asks, without a key) and each replica's gRPC server.
Only Serve's proxy listens on `--host`. With an API key, the proxy's own paths (/-/routes,
/-/healthz, which no replica sees) ask for it too (`ProxyGate`). A cluster joined with
`--ray-address` keeps its own ports, and its Serve, if it was already running, its own proxy.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from smcspec.server.api_error import error_body
from smcspec.server.guard import _key_problem

LOOPBACK = "127.0.0.1"
# Ray binds its daemons, agents and exporters to loopback only when the node's address is
# 127.0.0.1, and on Linux it swaps a given 127.0.0.1 for the machine's outward address unless
# clusters are off (ray_constants.ENABLE_RAY_CLUSTER, read from this when Ray is imported). An
# instance started here has no other node to reach it.
NO_CLUSTERS = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Serve takes middlewares for its proxy only from a function named in this variable, which the
# proxy's process reads; the key's SHA-256 (never the key) travels beside it.
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_KEY_DIGEST = "SMCSPEC_PROXY_KEY_SHA256"
RAY_PATHS = "/-/"  # /-/routes and /-/healthz: answered by Ray's proxy itself


def loopback_ray() -> dict[str, Any]:
    """`ray.init`'s keywords for a new instance on loopback; this must run before Ray is first
    imported (see NO_CLUSTERS)."""
    os.environ.setdefault(*NO_CLUSTERS)
    return {"_node_ip_address": LOOPBACK}


class ProxyGate:
    """Asks Ray's own proxy paths for the API key (pure ASGI, in Ray's proxy): the proxy answers
    /-/routes and /-/healthz itself, so no replica's `Guard` sees them. Other paths go on to a
    replica, whose `Guard` checks them (and counts its refusals)."""

    def __init__(self, app: ASGIApp, key_digest: bytes) -> None:
        self.app, self.key_digest = app, key_digest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(RAY_PATHS):
            problem = _key_problem(scope, self.key_digest)
            if problem is not None:
                body = error_body(problem, code="invalid_api_key")
                refusal = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def proxy_middlewares() -> list:
    """Ray's proxy calls this at its start (it is named in `PROXY_CALLBACK`)."""
    from starlette.middleware import Middleware

    digest = os.environ.get(PROXY_KEY_DIGEST)
    return [Middleware(ProxyGate, key_digest=bytes.fromhex(digest))] if digest else []


def proxy_env(api_key: str | None) -> dict[str, str]:
    """The environment Serve's controller, and the proxies it starts, run with: `ProxyGate`
    installed when there is a key."""
    if api_key is None:
        return {}
    digest = hashlib.sha256(api_key.encode()).hexdigest()
    return {PROXY_CALLBACK: f"{__name__}:proxy_middlewares", PROXY_KEY_DIGEST: digest}


def internal_grpc_on_loopback() -> None:
    """Serve starts each replica's inter-deployment gRPC server on [::]:0 whatever the node's
    address (`ray.serve._private.replica`, in `_on_initialized`, once this app is built). On a
    node whose address is loopback nothing could use it from elsewhere: it listens on loopback
    too (tests/server/test_ray_serve_command.py lists what listens)."""
    import ray
    from ray.serve._private import replica as serve_replica

    if ray.util.get_node_ip_address() != LOOPBACK:
        return
    listen = serve_replica.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> int:
        return listen(server, address.replace("[::]:", f"{LOOPBACK}:", 1))

    serve_replica.add_port_to_grpc_server = on_loopback
