"""The replica set's settings and shared view (`smcspec.server.cluster`), without Ray: what
/health and /metrics of one replica say about all of them, and the Ray Serve options made."""

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from smcspec.bench.serving import parse_metrics
from smcspec.server.cluster import (
    STALE_S,
    Hub,
    ReplicaOptions,
    ReplicaView,
    deployment_options,
    parse_autoscale,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_server(served: int, running: int = 0, pages: int = 0):
    registry = CollectorRegistry()
    done = Counter("smcspec:request_success", "doc", ["model_name"], registry=registry)
    done.labels("tiny").inc(served)
    scheduler = SimpleNamespace(alive=True, running=running, queued=0)
    llm = SimpleNamespace(
        target=SimpleNamespace(pages=SimpleNamespace(used_pages=pages)),
        draft=SimpleNamespace(pages=SimpleNamespace(used_pages=pages)),
    )
    metrics = SimpleNamespace(registry=registry, done=done)
    return SimpleNamespace(scheduler=scheduler, llm=llm, metrics=metrics)


def replica_pair(clock: Clock):
    hub = Hub(clock)
    views = [
        ReplicaView(rid, fake_server(n, running=n, pages=n), hub.push, hub.entries, clock)
        for rid, n in (("a", 3), ("b", 5))
    ]
    return hub, views


def test_metrics_of_one_replica_cover_all_with_a_replica_label():
    clock = Clock()
    _, (a, b) = replica_pair(clock)
    b.push()
    text = a.render().decode()
    values = parse_metrics(text)
    assert values['smcspec:request_success_total{model_name="tiny",replica="a"}'] == 3.0
    assert values['smcspec:request_success_total{model_name="tiny",replica="b"}'] == 5.0
    assert text.count("# TYPE smcspec:request_success_total counter") == 1


def test_no_counter_reads_lower_than_in_an_earlier_scrape_whichever_replica_answers():
    clock = Clock()
    _, (a, b) = replica_pair(clock)
    a.push()  # a periodic push: a has served 3
    a.server.metrics.done.labels("tiny").inc(4)
    first = parse_metrics(a.render().decode())  # answered by a: 7, fresh
    second = parse_metrics(b.render().decode())  # answered by b: a's 7 from the hub
    key = 'smcspec:request_success_total{model_name="tiny",replica="a"}'
    assert first[key] == second[key] == 7.0


def test_the_hub_keeps_a_replicas_newest_push():
    hub = Hub(Clock())
    hub.push("a", 2, {"running": 2}, [])
    hub.push("a", 1, {"running": 1}, [])  # sent earlier, arrived later
    assert hub.entries()["a"][2] == {"running": 2}


def test_health_lists_every_live_replica_and_drops_a_silent_one():
    clock = Clock()
    hub, (a, b) = replica_pair(clock)
    b.push()
    clock.now += 1.5
    report = a.health()
    assert report["replica"] == "a"
    assert [(r["replica"], r["running"], r["kv_pages_in_use"]) for r in report["replicas"]] == [
        ("a", 3, 6),
        ("b", 5, 10),
    ]
    assert report["replicas"][1]["age_s"] == 1.5
    clock.now += STALE_S  # b died: no push since
    assert [r["replica"] for r in a.health()["replicas"]] == ["a"]
    assert 'replica="b"' not in a.render().decode()
    assert list(hub.entries()) == ["a"]  # b dropped; a pushed as it answered /metrics


def test_a_replica_that_cannot_reach_the_hub_answers_for_itself(caplog):
    def unreachable(*args):
        raise TimeoutError("hub")

    view = ReplicaView("a", fake_server(2), unreachable, unreachable)
    assert [r["replica"] for r in view.health()["replicas"]] == ["a"]
    assert 'replica="a"' in view.render().decode()
    assert sum("fetch to the hub failed" in r.getMessage() for r in caplog.records) == 1


def test_fixed_replicas_take_as_many_requests_as_their_scheduler_runs():
    chosen = deployment_options(ReplicaOptions(replicas=3, replica_cpus=2), 64, 5.0)
    assert chosen["num_replicas"] == 3 and "autoscaling_config" not in chosen
    assert chosen["max_ongoing_requests"] == 64
    assert chosen["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0}
    assert chosen["graceful_shutdown_timeout_s"] == 5.0
    assert ReplicaOptions(replica_cpus=2.5).torch_threads == 2


def test_autoscaling_aims_at_half_a_full_batch_unless_told():
    chosen = deployment_options(ReplicaOptions(autoscale=(1, 4)), 64, 5.0)
    assert "num_replicas" not in chosen
    assert chosen["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 32.0,
    }
    told = deployment_options(ReplicaOptions(autoscale=(2, 2), target_ongoing=8), 64, 5.0)
    assert told["autoscaling_config"]["target_ongoing_requests"] == 8


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"replicas": 0}, "--replicas"),
        ({"replicas": 2, "autoscale": (1, 2)}, "exclude each other"),
        ({"autoscale": (0, 2)}, "--autoscale"),
        ({"target_ongoing": 2.0}, "--target-ongoing"),
        ({"autoscale": (1, 2), "target_ongoing": 0.0}, "--target-ongoing"),
        ({"replica_cpus": 0.0}, "--replica-cpus"),
        ({"replica_gpus": -1.0}, "--replica-gpus"),
        ({"address": "head:port"}, "--ray-address"),
        ({"address": "ray://head"}, "--ray-address"),
    ],
)
def test_bad_replica_settings_name_their_flag(settings, named):
    with pytest.raises(ValueError, match=named):
        ReplicaOptions(**settings)


def test_addresses_and_autoscale_ranges_parse():
    for address in ("auto", "10.0.0.1:6379", "ray://head:10001"):
        assert ReplicaOptions(address=address).address == address
    assert parse_autoscale("1:4") == (1, 4)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_autoscale("4")


@pytest.mark.parametrize(
    "options",
    [
        ReplicaOptions(replicas=2, replica_gpus=1),
        ReplicaOptions(autoscale=(1, 4), target_ongoing=8),
    ],
    ids=["fixed", "autoscale"],
)
def test_ray_serve_takes_the_deployment_options_as_meant(options):
    """Ray ignores unknown autoscaling keys silently: every key must be one of its fields."""
    serve = pytest.importorskip("ray.serve")
    from ray.serve.config import AutoscalingConfig

    chosen = deployment_options(options, 64, 5.0)

    class Stub:
        pass

    deployment = serve.deployment(Stub, name="smcspec", **chosen)
    assert deployment.max_ongoing_requests == 64
    assert deployment.ray_actor_options == {"num_cpus": 1.0, "num_gpus": options.replica_gpus}
    fields = getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__
    if options.autoscale is None:
        assert deployment.num_replicas == 2
    else:
        assert set(chosen["autoscaling_config"]) <= set(fields)
        assert AutoscalingConfig(**chosen["autoscaling_config"]).max_replicas == 4
