"""The server as 2 replicas on a local Ray Serve instance (tiny models): the same completions as
the single-process server for the same seeds, requests spread over both replicas, streaming
through Ray's router, metrics of both with a `replica` label, and a replica killed under load.

One Ray instance per module (about 15 s to start on 2 cores), on one pytest-xdist worker.
"""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from smcspec.bench.serving import free_port, parse_metrics
from smcspec.server.cluster import ReplicaOptions
from smcspec.server.runtime import ServeDefaults
from tests.server.conftest import MODEL
from tests.server.test_api import SETTINGS, offline
from tests.server.test_limits import until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
ray_app = pytest.importorskip("smcspec.server.ray_app")

pytestmark = pytest.mark.xdist_group("ray")

DEFAULTS = ServeDefaults(MODEL, particles=4, draft_tokens=3, max_tokens=16)
PROMPT = "w1 w2 w3"


class Replicas:
    def __init__(self, url: str, llm) -> None:
        self.url, self.llm = url, llm

    def client(self, **kwargs):
        settings = {"api_key": "unused", "max_retries": 0, "timeout": 60, **kwargs}
        return openai.OpenAI(base_url=self.url + "/v1", **settings)

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=10).json()

    def live(self) -> dict[str, dict]:
        """Replica id -> its snapshot (the hub drops a replica silent for STALE_S seconds)."""
        return {r["replica"]: r for r in self.health().get("replicas", [])}


def start_serve(tries: int = 3) -> int:
    """Serve's HTTP proxy on a free port; its port. The port is free when picked, but Ray starts
    processes before the proxy binds it, and one of them (or another test's) can take it first
    (CI saw "Failed to bind to address"): then again on another port."""
    for attempt in range(1, tries + 1):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except Exception as err:
            if "Failed to bind" not in str(err) or attempt == tries:
                raise
            serve.shutdown()
        else:
            return port
    raise ValueError(f"tries must be >= 1, got {tries}")


@pytest.fixture(scope="module")
def replicas(tiny_llama_folder, tiny_llama_draft_folder, tiny_llm):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        address="local",  # never a cluster `ray start` left on the machine
        num_cpus=4,  # logical: 2 replicas and a replacement, on 2 cores
        num_gpus=0,
        include_dashboard=False,
        namespace=ray_app.NAMESPACE,
        object_store_memory=100 * 2**20,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        hub = ray_app.start_hub()
        port = start_serve()
        llm = {"target": str(tiny_llama_folder), "draft": str(tiny_llama_draft_folder)}
        llm |= {"dtype": "float32", "backend": "native"}
        # Float sums depend on the thread count: the replicas compute as this process does.
        spec = ray_app.ReplicaSpec(llm, DEFAULTS, threads=torch.get_num_threads())
        app = ray_app.application(spec, ReplicaOptions(replicas=2))
        serve.run(app, name=ray_app.APP_NAME, route_prefix="/")
        handle = Replicas(f"http://127.0.0.1:{port}", tiny_llm)
        assert until(lambda: len(handle.live()) == 2, 30), handle.health()
        yield handle
        del hub
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("extra", SETTINGS, ids=lambda s: s["method"])
def test_completions_through_ray_are_what_generate_gives(replicas, extra):
    out = replicas.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=9, seed=11, extra_body=extra
    )
    assert out.choices[0].text == offline(replicas, PROMPT, False, 11, 9, **extra)
    assert out.choices[0].text.strip()


def test_chat_streams_through_the_router(replicas):
    client = replicas.client()
    messages = [{"role": "user", "content": "w1 w2"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "seed": 5}
    text = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason is not None
    raw = requests.post(
        replicas.url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True},
        stream=True,
        timeout=60,
    )
    lines = [x for x in raw.iter_lines(decode_unicode=True) if x]
    assert lines[-1] == "data: [DONE]"


def test_concurrent_requests_are_spread_over_both_replicas_and_counted_by_each(replicas):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "method": "smc", "seed": 1}

    def one(i: int) -> str:
        r = requests.post(replicas.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-smcspec-replica"]

    with ThreadPoolExecutor(16) as pool:
        served_by = list(pool.map(one, range(32)))
    ids = set(replicas.live())
    assert set(served_by) == ids and len(ids) == 2

    def counted() -> dict[str, float]:
        metrics = parse_metrics(requests.get(replicas.url + "/metrics", timeout=10).text)
        return {
            rid: sum(
                v
                for k, v in metrics.items()
                if k.startswith("smcspec:request_success_total{") and f'replica="{rid}"' in k
            )
            for rid in ids
        }

    expected = {rid: served_by.count(rid) for rid in ids}
    assert until(lambda: all(counted()[r] >= expected[r] for r in ids), 10), counted()


def test_health_lists_each_replica_with_its_process(replicas):
    report = replicas.health()
    assert report["status"] == "ok" and report["replica"] in replicas.live()
    for row in report["replicas"]:
        assert row["pid"] > 0 and row["scheduler_alive"] is True
        assert {"running", "queued", "kv_pages_in_use"} <= set(row)


def test_a_replica_killed_under_load_fails_only_its_requests_and_is_replaced(replicas):
    """Every request completes or fails with an error the client sees (none hangs: each
    client thread is joined with a deadline); Ray starts a new replica; the survivor ends with
    no request running and no KV page in use."""
    before = replicas.live()
    victim, survivor = sorted(before)
    stop = threading.Event()
    outcomes: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        c = replicas.client(timeout=30)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "seed": i}
        body["extra_body"] = {"method": "smc", "particles": 6, "ignore_eos": True}
        while not stop.is_set():
            try:
                if i % 2:
                    text = "".join(
                        ch.choices[0].text
                        for ch in c.completions.create(**body, stream=True)
                        if ch.choices
                    )
                else:
                    text = c.completions.create(**body).choices[0].text
                outcome = "ok" if text else "empty"
            except (openai.APIError, requests.RequestException) as e:
                outcome = f"error: {type(e).__name__}"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    assert until(lambda: before[victim]["pid"] and _running(replicas, victim), 20)
    os.kill(before[victim]["pid"], signal.SIGKILL)
    time.sleep(3.0)  # the load goes on while Ray notices and restarts the replica
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert outcomes and all(o == "ok" or o.startswith("error:") for o in outcomes), outcomes
    print("outcomes under the kill:", {o: outcomes.count(o) for o in set(outcomes)})
    assert outcomes.count("ok") > 0

    def replaced() -> bool:
        live = replicas.live()
        return len(live) == 2 and victim not in live and survivor in live

    assert until(replaced, 60), replicas.health()
    assert until(lambda: _idle(replicas.live().get(survivor)), 10), replicas.health()
    # seeded and past EOS: an unseeded draw may end at EOS first and return no text at all
    text = replicas.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, seed=0, extra_body={"ignore_eos": True}
    )
    assert text.choices[0].text.strip()


def _running(replicas: Replicas, replica: str) -> bool:
    return replicas.live().get(replica, {}).get("running", 0) > 0


def _idle(row: dict | None) -> bool:
    return (
        row is not None
        and row["running"] == 0
        and row["queued"] == 0
        and row["kv_pages_in_use"] == 0
    )
