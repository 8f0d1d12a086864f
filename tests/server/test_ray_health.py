"""Ray's health check on a replica (`ReplicaBase.check_health`), without a Ray cluster: Ray
replaces a replica only when the check raises, so a replica whose scheduler thread has stopped
must raise, and a live one must not (Ray would otherwise restart it every few seconds).

The replica is the real app over the tiny pair; its scheduler is stopped for real (the thread
ends). With Ray installed, the same check also runs on the class `serve.ingress` makes, as
`application` makes it: that is where `self.app` comes from, so a check that read some other
attribute would fail there and not in the stub."""

import asyncio
import gc
import warnings

import pytest

from smcspec.server.app import create_app
from smcspec.server.ray_app import ReplicaBase, ReplicaHeader
from smcspec.server.runtime import ServeDefaults
from tests.server.conftest import MODEL

DEFAULTS = ServeDefaults(MODEL, particles=2, draft_tokens=2, max_tokens=4)


class Replica(ReplicaBase):
    """What Ray's ingress wrapper provides the deployment class: the app as `self.app`."""

    def __init__(self, app: ReplicaHeader) -> None:
        self.app = app


@pytest.fixture
def header(tiny_llm):
    header = ReplicaHeader(create_app(tiny_llm, DEFAULTS), "replica-0")
    yield header
    header.server.shutdown()


def stop_scheduler(header: ReplicaHeader) -> None:
    scheduler = header.server.scheduler
    scheduler.shutdown()
    assert not scheduler._thread.is_alive(), "the scheduler thread did not stop"


def test_check_health_passes_while_the_scheduler_runs_and_raises_once_it_stops(header):
    replica = Replica(header)
    replica.check_health()
    stop_scheduler(header)
    with pytest.raises(RuntimeError, match="scheduler thread has stopped"):
        replica.check_health()


def test_check_health_on_rays_ingress_class_reads_the_built_app(header):
    serve = pytest.importorskip("ray.serve")

    def build() -> ReplicaHeader:
        return header

    # The class `application` deploys; Ray awaits its (async) __init__ in the replica.
    wrapped = serve.ingress(build)(ReplicaBase)
    replica = wrapped.__new__(wrapped)
    asyncio.run(replica.__init__())
    try:
        assert replica.app is header
        replica.check_health()
        stop_scheduler(header)
        with pytest.raises(RuntimeError, match="scheduler thread has stopped"):
            replica.check_health()
    finally:
        # Ray awaits the wrapper's async __del__ when it stops a replica; here the collector
        # calls it and drops the coroutine, which would warn in whichever test runs next.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            del replica
            gc.collect()
