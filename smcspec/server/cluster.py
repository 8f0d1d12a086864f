"""What a replica knows of the others when the server runs as replicas (`server.ray_app`): the
settings of the replica set, and the shared view behind /health and /metrics.

Each replica pushes a snapshot of itself (pid, scheduler state, KV pages in use) and its metric
families, labelled `replica`, to one hub about every `PUSH_S` seconds (and when it answers
/metrics). Whichever replica answers /metrics renders its own families fresh and the others'
from the hub; a replica not heard from for `STALE_S` seconds (it died, or was replaced) drops
out of both. Nothing here imports Ray: the
hub is any object with `push` and `entries` (a Ray actor in `ray_app`, a plain object in tests).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric

LOG = logging.getLogger("smcspec.server")
PUSH_S = 1.0
STALE_S = 5.0


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas, where, and on what resources. `replicas` and `autoscale` (min, max)
    exclude each other; `target_ongoing` (requests per replica that autoscaling aims at) goes
    only with `autoscale`; `address` joins a running Ray cluster ("auto", "host:port" or
    "ray://host:port"), None starts one on this machine."""

    replicas: int | None = None
    autoscale: tuple[int, int] | None = None
    target_ongoing: float | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    address: str | None = None

    def __post_init__(self) -> None:
        if self.replicas is not None and self.autoscale is not None:
            raise ValueError("--replicas and --autoscale exclude each other: give one")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ValueError(f"--replicas must be an integer >= 1, got {self.replicas!r}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 1 <= low <= high:
                raise ValueError(f"--autoscale MIN:MAX needs 1 <= MIN <= MAX, got {low}:{high}")
        if self.target_ongoing is not None:
            if self.autoscale is None:
                raise ValueError("--target-ongoing goes with --autoscale")
            if not 0 < self.target_ongoing < math.inf:
                raise ValueError(f"--target-ongoing must be > 0, got {self.target_ongoing}")
        if not 0 < self.replica_cpus < math.inf:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if not 0 <= self.replica_gpus < math.inf:
            raise ValueError(f"--replica-gpus must be >= 0, got {self.replica_gpus}")
        if self.address is not None:
            _split_address(self.address)

    @property
    def initial_replicas(self) -> int:
        return self.autoscale[0] if self.autoscale is not None else self.replicas or 1

    @property
    def torch_threads(self) -> int:
        """A replica computes on as many threads as it reserved CPUs (at least one)."""
        return max(1, int(self.replica_cpus))


def require_ray() -> None:
    """A RuntimeError saying how to install Ray when it is missing (checked before anything
    starts: the replica mode of `serve` and of `bench serve`)."""
    if importlib.util.find_spec("ray") is None:
        raise RuntimeError("replicas run on Ray Serve: pip install 'smcspec[ray]'")


def parse_autoscale(text: str) -> tuple[int, int]:
    """ "MIN:MAX" -> (MIN, MAX)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"--autoscale takes MIN:MAX (e.g. 1:4), got {text!r}") from None


def _split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" or "ray://host:port"; None for "auto" (Ray looks it up)."""
    if address == "auto":
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--ray-address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}"
        )
    return host, int(port)


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """A RuntimeError in one line when nothing listens at a host:port address: `ray.init`
    would otherwise retry for a minute and print pages of logs."""
    where = _split_address(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        message = f"--ray-address {address}: no Ray cluster answers there ({reason})"
        raise RuntimeError(message) from None


def deployment_options(options: ReplicaOptions, max_running: int, shutdown_s: float) -> dict:
    """Ray Serve deployment settings for the replica set. A replica takes as many requests as
    its scheduler decodes at once (`max_running` of the `EngineLimits` its LLM is built with);
    Ray holds the rest and hands each to the replica that frees a slot first (Ray's default of
    5 would starve continuous batching)."""
    chosen: dict[str, Any] = {
        "max_ongoing_requests": max_running,
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": shutdown_s,
        "ray_actor_options": {"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
    }
    if options.autoscale is None:
        chosen["num_replicas"] = options.initial_replicas
    else:
        low, high = options.autoscale
        target = options.target_ongoing or max(1.0, max_running / 2)
        chosen["autoscaling_config"] = {
            "min_replicas": low,
            "initial_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": target,
        }
    return chosen


# -- the shared view --------------------------------------------------------------------------


Entry = tuple[float, int, dict, list[Metric]]  # (pushed at, sequence number, snapshot, families)


class Hub:
    """Holds the latest push of every replica (what the Ray actor in `ray_app` wraps). A push
    older than the one held (by the replica's own sequence number) is ignored, so what the hub
    holds of a replica only moves forward."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[str, Entry] = {}

    def push(self, replica: str, seq: int, snapshot: dict, families: list[Metric]) -> None:
        held = self._entries.get(replica)
        if held is None or seq > held[1]:
            self._entries[replica] = (self._clock(), seq, snapshot, families)

    def entries(self) -> dict[str, Entry]:
        """The replicas heard from in the last STALE_S seconds (older ones are dropped)."""
        now = self._clock()
        self._entries = {r: e for r, e in self._entries.items() if now - e[0] <= STALE_S}
        return dict(self._entries)


class ReplicaView:
    """One replica's side of the shared view: it pushes itself to the hub from a daemon thread
    and answers /health and /metrics for the whole set. `fetch` returns the hub's entries and
    `send` pushes (replica, seq, snapshot, families); both may raise when the hub is
    unreachable, in which case the replica answers for itself alone.

    /metrics pushes this replica's fresh values before it reads the others' from the hub:
    whichever replica answers a scrape, no counter reads lower than in an earlier scrape."""

    def __init__(
        self,
        replica: str,
        server: Any,
        send: Callable[[str, int, dict, list[Metric]], None] | None,
        fetch: Callable[[], dict[str, Entry]] | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica, self.server = replica, server
        self._send, self._fetch, self._clock = send, fetch, clock
        self._stop = threading.Event()
        self._warned: set[tuple[str, type]] = set()
        self._seq = 0
        self._lock = threading.Lock()  # sequence numbers in the order the values were read

    def snapshot(self) -> dict:
        s = self.server.scheduler
        pages = [getattr(m, "pages", None) for m in (self.server.llm.target, self.server.llm.draft)]
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "scheduler_alive": s.alive,
            "running": s.running,
            "queued": s.queued,
            "kv_pages_in_use": sum(p.used_pages for p in pages if p is not None),
        }

    def families(self) -> list[Metric]:
        return list(labelled(self.server.metrics.registry.collect(), self.replica))

    def push(self) -> list[Metric]:
        """Send this replica's values now; return its families as sent."""
        with self._lock:
            self._seq += 1
            seq, snapshot, families = self._seq, self.snapshot(), self.families()
        if self._send is not None:
            self._send(self.replica, seq, snapshot, families)
        return families

    def start(self) -> None:
        threading.Thread(target=self._pushing, name="smcspec-replica-push", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _pushing(self) -> None:
        while not self._stop.is_set():
            try:
                self.push()
            except Exception as e:  # the hub restarting or gone: the next push tries again
                self._warn("push", e)
            self._stop.wait(PUSH_S)

    def _warn(self, what: str, error: Exception) -> None:
        """Once per kind of failure: the replica's log says why the others are missing."""
        key = (what, type(error))
        if key not in self._warned:
            self._warned.add(key)
            LOG.warning("replica %s: %s to the hub failed: %r", self.replica, what, error)

    def others(self) -> dict[str, Entry]:
        try:
            entries = dict(self._fetch()) if self._fetch is not None else {}
        except Exception as e:  # no hub: this replica answers for itself
            self._warn("fetch", e)
            entries = {}
        entries.pop(self.replica, None)
        return entries

    def health(self) -> dict:
        """What /health adds: this replica's id and every live replica's snapshot."""
        now = self._clock()
        rows = [{**self.snapshot(), "age_s": 0.0}]
        for pushed, _, snap, _ in self.others().values():
            rows.append({**snap, "age_s": round(max(0.0, now - pushed), 3)})
        rows.sort(key=lambda r: r["replica"])
        return {"replica": self.replica, "replicas": rows}

    def render(self) -> bytes:
        """Prometheus text of every live replica's metrics, each sample labelled `replica`."""
        try:
            own = self.push()
        except Exception as e:
            self._warn("push", e)
            own = self.families()
        groups = [own] + [entry[3] for entry in self.others().values()]
        return generate_latest(_Merged(groups))


def labelled(families: Iterable[Metric], replica: str) -> Iterator[Metric]:
    """Copies of `families` whose samples carry the label replica=<id>."""
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        yield copy


class _Merged:
    """A collector of several replicas' families: one family per name, all their samples."""

    def __init__(self, groups: list[list[Metric]]) -> None:
        self.groups = groups

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for families in self.groups:
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples.extend(family.samples)
        yield from merged.values()
