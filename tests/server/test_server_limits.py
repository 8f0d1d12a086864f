"""The server's limits: the engine's come from the LLM (`llm.limits`), the HTTP ones from
`ServeDefaults.http`; `Server.limits()` reports both as built (the pool's real size), and each
Ray replica's deployment takes max_running from the limits its LLM is built with."""

import sys
import types

import pytest

from smcspec import LLM
from smcspec.config import EngineLimits, HTTPLimits
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.server import ray_app
from smcspec.server.cluster import ReplicaOptions
from smcspec.server.runtime import ServeDefaults, Server

HTTP = HTTPLimits(max_body_bytes=1000, shutdown_timeout=2.5, read_timeout=3.0, write_timeout=4.0)


@pytest.fixture
def server_of():
    """A `Server` over an LLM, shut down after the test."""
    made = []

    def build(llm: LLM, defaults: ServeDefaults) -> Server:
        made.append(Server(llm, defaults))
        return made[-1]

    yield build
    for server in made:
        server.shutdown()


def test_limits_report_the_pool_as_built_and_the_http_limits(
    tiny_llama_folder, tiny_llama_draft_folder, server_of, monkeypatch
):
    """Half of 1 MiB free gives each tiny model 63 pages (tests/models/test_kv_pool.py).
    Failed on: the Server's scheduler built with the Scheduler's defaults instead of
    llm.limits (64 / 256); kv_pages read from the limits rather than the pool (None)."""
    monkeypatch.setattr("smcspec.models.native.free_bytes", lambda device: 2**20)
    limits = EngineLimits(max_running=3, max_batch_tokens=9, kv_memory=0.5)
    folders = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    llm = LLM(*folders, backend="native", dtype="float32", limits=limits)
    server = server_of(llm, ServeDefaults("tiny", http=HTTP))
    assert server.scheduler.max_running == 3 and server.scheduler.max_batch_tokens == 9
    assert server.limits() == {
        "max_running": 3,
        "max_batch_tokens": 9,
        "kv_pages": 63,
        "page_size": 16,
        "max_body_bytes": 1000,
        "shutdown_timeout": 2.5,
        "read_timeout": 3.0,
        "write_timeout": 4.0,
    }


def test_health_reports_the_limits_the_server_runs_within(
    tiny_llama_folder, tiny_llama_draft_folder
):
    """/health carries `Server.limits()`: what admission uses, not the classes' defaults.
    Failed on: /health built from EngineLimits() and HTTPLimits() (64 where 3 was set)."""
    from fastapi.testclient import TestClient

    from smcspec.server.app import create_app

    limits = EngineLimits(max_running=3, max_batch_tokens=9, kv_pages=40)
    folders = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    llm = LLM(*folders, backend="native", dtype="float32", limits=limits)
    with TestClient(create_app(llm, ServeDefaults("tiny", http=HTTP))) as client:
        reported = client.get("/health").json()["limits"]
    assert reported == {
        "max_running": 3,
        "max_batch_tokens": 9,
        "kv_pages": 40,
        "page_size": 16,
        "max_body_bytes": 1000,
        "shutdown_timeout": 2.5,
        "read_timeout": 3.0,
        "write_timeout": 4.0,
    }


def test_models_without_a_paged_pool_report_none(server_of):
    """Failed on: page_size reported from the limits (16) for models that have no pages."""
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, 2, 0.5))
    got = server_of(llm, ServeDefaults("m")).limits()
    assert (got["kv_pages"], got["page_size"]) == (None, None)
    assert (got["max_running"], got["max_body_bytes"]) == (64, 4 * 2**20)


def test_serve_defaults_hold_the_http_limits_and_no_engine_limits():
    defaults = ServeDefaults("m")
    assert defaults.http == HTTPLimits()
    assert not hasattr(defaults, "max_running") and not hasattr(defaults, "max_batch_tokens")
    with pytest.raises(ValueError, match=r"^http must be an HTTPLimits"):
        ServeDefaults("m", http={"read_timeout": 1.0})


@pytest.fixture
def fake_serve(monkeypatch):
    """`ray.serve` as far as `application` uses it: the deployment options it is given."""
    serve = types.SimpleNamespace(
        ingress=lambda build: lambda cls: cls,
        deployment=lambda cls, name, **chosen: types.SimpleNamespace(bind=lambda: chosen),
    )
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(serve=serve))
    monkeypatch.setitem(sys.modules, "ray.serve", serve)


def test_each_replica_takes_as_many_requests_as_its_llm_runs(fake_serve):
    """Failed on: `application` reading EngineLimits() rather than the replica's LLM's limits
    (64 ongoing requests)."""
    llm = {"target": "t", "limits": EngineLimits(max_running=7)}
    spec = ray_app.ReplicaSpec(llm, ServeDefaults("m", http=HTTP))
    chosen = ray_app.application(spec, ReplicaOptions(replicas=2))
    assert chosen["max_ongoing_requests"] == 7
    assert chosen["graceful_shutdown_timeout_s"] == 2.5
    plain = ray_app.ReplicaSpec({"target": "t"}, ServeDefaults("m"))
    assert ray_app.application(plain, ReplicaOptions(replicas=2))["max_ongoing_requests"] == 64


@pytest.mark.parametrize(("max_tokens", "status"), [(109, 200), (110, 400)], ids=["at", "past"])
def test_a_request_needing_the_whole_pool_is_served_and_one_page_more_is_a_400(
    tiny_llama_folder, tiny_llama_draft_folder, max_tokens, status
):
    """The HTTP path of the pool's limit (tests/engine/test_engine_limits.py has the engine's):
    3 + 109 positions need the pool's 8 pages with the spare one, 3 + 110 need 9. Failed on:
    pools.oversized's `need >= cap` (at)."""
    from fastapi.testclient import TestClient

    from smcspec.server.app import create_app

    folders = str(tiny_llama_folder), str(tiny_llama_draft_folder)
    llm = LLM(*folders, backend="native", dtype="float32", limits=EngineLimits(kv_pages=8))
    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": max_tokens, "method": "ar"}
    body |= {"ignore_eos": True}
    with TestClient(create_app(llm, ServeDefaults("tiny"))) as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    if status == 400:
        assert "needs up to 9 KV pages" in resp.json()["error"]["message"]
