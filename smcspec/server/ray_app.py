"""The server as replicas on Ray Serve (`smcspec serve --replicas N`, `pip install smcspec[ray]`).

Each replica is one Ray actor holding one engine (target + draft, its continuous-batching
scheduler) behind the same OpenAI app as the single-process server (`create_app`); Ray's proxy
routes every request to the replica with the shortest queue, restarts a replica whose process
dies or whose scheduler thread has stopped (`check_health`), and adds or removes replicas under
`--autoscale`. /health and /metrics on any replica cover all of them (`server.cluster`); every
response names the replica that made it in the `x-smcspec-replica` header.

Shutdown is the single-process server's: on SIGTERM (or SIGINT) every replica refuses new
requests with a 503 and gives running ones `shutdown_timeout` seconds before it cancels them (a
waiting client gets a 503, a stream an error event, then `data: [DONE]`); only then is the app
removed. The `Stopper` actor carries the word to every replica, which Ray's router cannot do.

A Ray instance started here listens on loopback only, and Ray's own proxy paths ask for the
API key (`server.ray_exposure`).

Ray is imported only here and there, and only when replicas are asked for.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from smcspec.config import EngineLimits
from smcspec.server.cluster import (
    Hub,
    ReplicaOptions,
    ReplicaView,
    deployment_options,
)
from smcspec.server.http import CLOSE_S
from smcspec.server.ray_exposure import (
    LOOPBACK,
    internal_grpc_on_loopback,
    loopback_ray,
    proxy_env,
)
from smcspec.server.runtime import ServeDefaults, Server

APP_NAME = "smcspec"
NAMESPACE = "smcspec"
HUB_NAME = "smcspec-metrics-hub"
STOPPER_NAME = "smcspec-stopper"
REPLICA_HEADER = "x-smcspec-replica"
HUB_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: the `LLM`'s keyword arguments (its `limits` among them), the
    server's defaults, and the number of threads torch computes on."""

    llm: dict[str, Any]
    defaults: ServeDefaults
    threads: int = 1

    @property
    def limits(self) -> EngineLimits:
        """The engine limits each replica's `LLM` is built with."""
        return self.llm.get("limits") or EngineLimits()


class ReplicaHeader:
    """Names the replica on every response (pure ASGI), and keeps the replica's `Server` at
    hand for Ray's health check."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.replica = app, replica
        self.server = app.state.server
        self._header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, named)


class ReplicaBase:
    """The deployment class; Ray wraps it around the app `build_replica_app` returns."""

    def check_health(self) -> None:
        """Ray calls this every few seconds; raising makes Ray replace the replica."""
        if not self.app.server.scheduler.alive:  # type: ignore[attr-defined]
            raise RuntimeError("the replica's scheduler thread has stopped")


class Stopper:
    """The named actor that tells every replica to drain (Ray's router reaches one replica per
    call, never all). Each replica keeps a `wait` pending from its start (an async actor holds
    them all) and reports `drained` once its requests are done. A replica that dies stays
    pending: whoever waits on `pending` bounds the wait."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._pending: set[str] = set()

    async def wait(self, replica: str) -> None:
        self._pending.add(replica)
        await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()

    async def drained(self, replica: str) -> None:
        self._pending.discard(replica)

    async def pending(self) -> int:
        return len(self._pending)


def drain(server: Server, grace_s: float) -> None:
    """`app.HTTPServer`'s shutdown in one replica: new requests get a 503 at once, running ones
    have `grace_s` seconds to finish, then they are cancelled (a waiting client gets a 503, a
    stream an error event and `data: [DONE]`), and get CLOSE_S more to send that."""
    server.draining = True
    _idle_within(server, grace_s)
    server.cancel_all()
    _idle_within(server, CLOSE_S)


def _idle_within(server: Server, seconds: float) -> None:
    end = time.monotonic() + seconds
    s = server.scheduler
    while (s.running or s.queued) and time.monotonic() < end:
        time.sleep(0.05)


def build_replica_app(spec: ReplicaSpec) -> ReplicaHeader:
    """Runs in the replica's process, when Ray starts it: the engine and its app."""
    import torch

    from smcspec.engine import LLM
    from smcspec.server.app import create_app

    torch.set_num_threads(spec.threads)
    internal_grpc_on_loopback()
    replica = _replica_id()
    send, fetch = _hub_calls()
    llm = LLM(**spec.llm)
    app = create_app(
        llm, spec.defaults, replica=lambda server: ReplicaView(replica, server, send, fetch)
    )
    _drain_when_told(app.state.server, replica, spec.defaults.http.shutdown_timeout)
    return ReplicaHeader(app, replica)


def _drain_when_told(server: Server, replica: str, grace_s: float) -> None:
    """A daemon thread that waits on the `Stopper` (when one runs), then drains the replica."""
    import ray

    try:
        stopper = ray.get_actor(STOPPER_NAME, namespace=NAMESPACE)
    except ValueError:  # an app deployed without `start_stopper`: Ray's own shutdown only
        return

    def run() -> None:
        try:
            ray.get(stopper.wait.remote(replica))
        except Exception:  # the stopper is gone with its driver: nobody asks for a drain
            return
        drain(server, grace_s)
        stopper.drained.remote(replica)

    threading.Thread(target=run, name="smcspec-drain", daemon=True).start()


def application(spec: ReplicaSpec, options: ReplicaOptions):
    """The Ray Serve application (`serve.run` it) of `options`' replicas, each built from
    `spec`."""
    from ray import serve

    def build() -> ReplicaHeader:
        return build_replica_app(spec)

    d = spec.defaults
    chosen = deployment_options(options, spec.limits.max_running, d.http.shutdown_timeout)
    replica_class = serve.ingress(build)(ReplicaBase)
    return serve.deployment(replica_class, name=APP_NAME, **chosen).bind()


def start_hub():
    """The named actor the replicas push to. Ray removes it when the caller's handle goes (it
    is not detached): keep the handle for as long as the app runs."""
    import ray

    actor = ray.remote(num_cpus=0)(Hub)
    return actor.options(name=HUB_NAME, namespace=NAMESPACE).remote()


def start_stopper():
    """The named `Stopper` the replicas wait on, started before them (a replica looks for it
    once, when it starts). Kept as `start_hub`'s handle is."""
    import ray

    actor = ray.remote(num_cpus=0)(Stopper)
    return actor.options(name=STOPPER_NAME, namespace=NAMESPACE).remote()


def _hub_calls():
    """(send, fetch) against the hub, or (None, None) when none runs (an app deployed without
    `start_hub`: each replica then reports only itself)."""
    import ray

    try:
        hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
    except ValueError:
        return None, None

    def send(replica: str, seq: int, snapshot: dict, families: list) -> None:
        ray.get(hub.push.remote(replica, seq, snapshot, families), timeout=HUB_TIMEOUT_S)

    def fetch() -> dict:
        return ray.get(hub.entries.remote(), timeout=HUB_TIMEOUT_S)

    return send, fetch


def _replica_id() -> str:
    from ray import serve

    context = serve.get_replica_context()
    found = getattr(getattr(context, "replica_id", None), "unique_id", None)
    return str(found or context.replica_tag)


def serve_replicas(spec: ReplicaSpec, options: ReplicaOptions, host: str, port: int) -> None:
    """`smcspec serve` with replicas: start (or join) Ray, run the app on host:port, and serve
    until SIGINT or SIGTERM; then drain the replicas, remove the app (and stop Ray if this
    process started it)."""
    local = options.address is None  # the caller has probed a given address (check_reachable)
    extra = {"include_dashboard": False, **loopback_ray()} if local else {}
    import ray
    from ray import serve

    try:
        ray.init(
            # "local": a new instance, never one that `ray start` left running (this process
            # shuts its instance down at exit, which must not hit somebody else's).
            address="local" if local else options.address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
            **extra,
        )
    except ConnectionError as e:
        raise RuntimeError(f"--ray-address {options.address}: {e}") from None
    node = ray.util.get_node_ip_address()
    if local and node != LOOPBACK:  # Ray was imported before `loopback_ray` could set it up
        print(f"smcspec: warning: Ray's own ports listen on {node}, not loopback", file=sys.stderr)
    serving = False  # whether Serve runs on the cluster: only then is there an app to remove
    _stop_on_sigterm()  # from here on, as Ctrl-C: through the clean-up below
    try:
        _check_fits(options, local)
        hub = start_hub()  # noqa: F841 (held: the hub lives as long as this handle)
        stopper = start_stopper()
        gate = proxy_env(spec.defaults.api_key)  # the proxies inherit the controller's env
        controller = {"runtime_env": {"env_vars": gate}} if gate else None
        serve.start(http_options={"host": host, "port": port}, controller_options=controller)
        serving = True
        _run_app(spec, options)
        low, high = options.autoscale or (options.initial_replicas,) * 2
        count = str(low) if low == high else f"{low} to {high}"
        print(
            f"smcspec: serving {spec.defaults.model_name!r} on {count} replica(s) (Ray Serve) at "
            f"http://{host}:{port}/v1",
            file=sys.stderr,
        )
        _wait_for_stop()
    finally:
        # A second signal must not cut the clean-up short: Ray's processes would outlive us.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        grace = spec.defaults.http.shutdown_timeout
        if serving:
            _bounded(lambda: _drain_all(stopper, grace), grace + CLOSE_S + 15.0, "draining")
        _stop(local, serving, grace)


def _run_app(spec: ReplicaSpec, options: ReplicaOptions) -> None:
    """Deploy the replicas and wait until they serve; a replica that cannot start (a model
    that fails to load, say) is a one-line error that points at Ray's logs."""
    from ray import serve

    try:
        serve.run(application(spec, options), name=APP_NAME, route_prefix="/")
    except Exception as e:  # Ray's message holds the replica's whole traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"the replicas did not start ({first}); their logs are in Ray's session folder "
            "(/tmp/ray/session_latest/logs on each node)"
        ) from None


def _check_fits(options: ReplicaOptions, local: bool) -> None:
    """The first replicas must fit the cluster's CPUs and GPUs, or Ray would wait for them
    forever: an error on a cluster this process started, a warning on a joined one (its
    autoscaler may add nodes)."""
    import ray

    have = ray.cluster_resources()
    n = options.initial_replicas
    for what, each in (("CPU", options.replica_cpus), ("GPU", options.replica_gpus)):
        if each and n * each > have.get(what, 0.0):
            message = (
                f"{n} replica(s) x {each:g} {what} need {n * each:g} {what}s; the Ray cluster "
                f"has {have.get(what, 0.0):g} (see --replica-cpus / --replica-gpus)"
            )
            if local:
                raise ValueError(message)
            print(f"smcspec: warning: {message}", file=sys.stderr)


def _stop_on_sigterm() -> None:
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _wait_for_stop() -> None:
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("smcspec: stopping the replicas", file=sys.stderr)


def _drain_all(stopper: Any, grace_s: float) -> None:
    """Tell every replica to drain (`drain`) and wait until each has, or has had the time to."""
    import ray

    ray.get(stopper.stop.remote(), timeout=HUB_TIMEOUT_S)
    end = time.monotonic() + grace_s + CLOSE_S + 1.0
    while ray.get(stopper.pending.remote(), timeout=HUB_TIMEOUT_S) and time.monotonic() < end:
        time.sleep(0.1)


def _stop(local: bool, serving: bool, grace_s: float) -> None:
    """Remove the app (its replicas get `grace_s` to finish), then Serve and Ray if this
    process started them. Each step is bounded: a SIGTERM sent to the whole process group
    (`timeout`, systemd) also kills Ray's own daemons, and then Serve would wait forever."""
    import ray
    from ray import serve

    try:
        if serving:
            _bounded(lambda: serve.delete(APP_NAME), grace_s + 15.0, "removing the app")
            if local:
                _bounded(serve.shutdown, 15.0, "stopping Serve")
    finally:
        ray.shutdown()


def _bounded(step: Any, seconds: float, what: str) -> None:
    """Run `step` for at most `seconds` (in a daemon thread: a step stuck on a dead Ray daemon
    cannot hold the process)."""
    done = threading.Event()

    def run() -> None:
        try:
            step()
        except Exception as e:  # Ray's daemons gone: one line, and on to the next step
            print(f"smcspec: {what} failed ({type(e).__name__}: {e}); going on", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=run, name=f"smcspec-{what}", daemon=True).start()
    if not done.wait(seconds):
        print(f"smcspec: {what} took over {seconds:g} s; going on", file=sys.stderr)
