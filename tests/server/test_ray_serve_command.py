"""`smcspec serve --replicas 2` as a user starts it (a subprocess on its own local Ray, with an
API key, on 127.0.0.1): nothing of Ray listens beyond the host served on, Ray's own proxy paths
ask for the key, and SIGTERM drains as the single-process server does (every stream ends with
its text or an error event, then `data: [DONE]`; a request during the drain gets a 503).

One server for the module (Ray starts in about 25 s on 2 cores). The SIGTERM test stops it, so
it comes last.
"""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from smcspec.bench.serving import free_port, wait_ready

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.xdist_group("ray")

MODEL = "tiny-pair"
KEY = "sk-ray-shutdown-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 1.0
BIND_TRIES = 3  # starts of the server, each on a fresh port, before the fixture fails
EXIT_S = 45.0  # the drain, then Serve's and Ray's own clean-up on a busy 2-core machine


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def processes(self) -> list[psutil.Process]:
        """The server and every process under it (Ray's daemons and workers), remembered so that
        the clean-up can find one whose parent is gone."""
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return [p for p in self.seen.values() if p.is_running()]


@pytest.fixture(scope="module")
def served(tiny_llama_folder, tiny_llama_draft_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray-serve")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for attempt in range(BIND_TRIES):
        # a port free when asked may be taken before Ray's proxy binds it (Ray's own daemons
        # bind ports meanwhile): a start that fails to bind tries another port
        port = free_port()
        cmd = [sys.executable, "-m", "smcspec", "serve", "--replicas", "2"]
        cmd += ["--replica-cpus", "0.5", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--api-key", KEY, "--target", str(tiny_llama_folder)]
        cmd += ["--draft", str(tiny_llama_draft_folder), "--dtype", "float32"]
        cmd += ["--model-name", MODEL, "--shutdown-timeout", str(GRACE_S)]
        log = folder / f"serve-{attempt}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        handle = Served(f"http://127.0.0.1:{port}", port, proc)
        try:
            wait_ready(handle.url, proc, timeout=240, replicas=2)
            break
        except RuntimeError:
            _stop(handle)
            if "Failed to bind to address" not in log.read_text() or attempt + 1 == BIND_TRIES:
                pytest.fail(f"smcspec serve did not come up: {log.read_text()[-3000:]}")
    try:
        handle.processes()
        yield handle
    finally:
        _stop(handle)


def _stop(served: Served) -> None:
    """SIGTERM, then SIGKILL to whatever of the tree is left: no Ray process outlives the
    module, whatever the test did."""
    left = served.processes()
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
        try:
            served.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait(timeout=30)
    _, alive = psutil.wait_procs(left, timeout=10)
    for p in alive:
        p.kill()


def _listening(served: Served) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of the server's tree."""
    rows = []
    for p in served.processes():
        try:
            name = p.name()
            rows += [
                (c.laddr.ip, c.laddr.port, name)
                for c in p.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:
            pass
    return sorted(rows)


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's view
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_nothing_listens_beyond_the_host_served_on(served):
    """Served on 127.0.0.1: Ray's GCS, raylet, agents, metrics exporters and workers listen on
    loopback too (the metrics exporters would give the node's address, session and timings to
    anyone who can reach the machine, without the key)."""
    rows = _listening(served)
    print("listening:", *rows, sep="\n  ")
    assert ("127.0.0.1", served.port) in [(ip, port) for ip, port, _ in rows]
    assert len(rows) > 5  # Ray's daemons were seen, not just the proxy
    beyond = [row for row in rows if not _loopback(row[0])]
    assert not beyond, f"listening beyond 127.0.0.1: {beyond}"


@pytest.mark.parametrize("path", ["/-/routes", "/-/healthz"])
def test_rays_own_proxy_paths_need_the_key(served, path):
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        r = requests.get(served.url + path, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(served.url + path, headers=AUTH, timeout=10).status_code == 200
    # as in one process, /health stays open to load balancers
    assert requests.get(served.url + "/health", timeout=10).status_code == 200


def _until(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _running(served: Served) -> int:
    rows = requests.get(served.url + "/health", timeout=10).json().get("replicas", [])
    return sum(r["running"] + r["queued"] for r in rows)


def test_sigterm_ends_every_stream_with_done_and_answers_503_while_draining(served):
    """Streams of 4 choices each, on both replicas, running at SIGTERM: after the grace period
    each choice ends with its finish reason or a 'shutting down' error event, and each stream
    with `data: [DONE]`; a request 0.5 s after SIGTERM gets a JSON 503 (not Ray's 404); the
    server exits."""
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 100, "ignore_eos": True, "n": 4}
    body |= {"method": "smc", "particles": 64, "stream": True}
    opened = _open_streams_on_both_replicas(served, body)
    # at least: a stream closed by _open_streams_on_both_replicas counts until its replica's
    # next pass cancels it, which on a core shared with another test can take seconds
    assert _until(lambda: _running(served) >= body["n"] * len(opened), 120), "not all running"
    served.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    ends: dict[int, tuple[str, list[str], float]] = {}

    def read(i: int, r: requests.Response) -> None:
        lines = []
        try:
            lines += (x for x in r.iter_lines(decode_unicode=True) if x)
        except requests.RequestException as e:  # cut off mid-body
            lines.append(f"cut: {type(e).__name__}")
        ends[i] = (r.headers["x-smcspec-replica"], lines, time.monotonic() - sent)

    readers = [threading.Thread(target=read, args=item, daemon=True) for item in enumerate(opened)]
    for t in readers:
        t.start()
    time.sleep(max(0.0, sent + 0.5 - time.monotonic()))
    late = requests.post(
        served.url + "/v1/completions",
        json={"model": MODEL, "prompt": "w1", "max_tokens": 3},
        headers=AUTH,
        timeout=30,
    )
    for t in readers:
        t.join(timeout=60)
    served.proc.wait(timeout=EXIT_S + 30)
    took = time.monotonic() - sent
    print(f"\nexited {took:.1f} s after SIGTERM; 0.5 s after it: {late.status_code} {late.text}")
    for replica, lines, at in ends.values():
        print(f"  {replica}: ended {at:.1f} s after SIGTERM, last: {lines[-2:]}")

    assert late.status_code == 503, late.text
    assert "shutting down" in late.json()["error"]["message"]
    assert len(ends) == len(opened), "a stream did not end"
    errors = 0
    for replica, lines, _ in ends.values():
        assert lines[-1] == "data: [DONE]", (replica, lines[-3:])
        events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        failed = [e["error"]["message"] for e in events if "error" in e]
        assert all("shutting down" in m for m in failed), failed
        finished = {
            e["choices"][0]["index"]
            for e in events
            if "choices" in e and e["choices"] and e["choices"][0]["finish_reason"] is not None
        }
        assert len(finished) + len(failed) == body["n"], (replica, events[-5:])
        errors += len(failed)
    assert errors > 0, "no choice was still running after the grace period: nothing was drained"
    assert took < EXIT_S, f"the server took {took:.1f} s to exit"


def _open_streams_on_both_replicas(served: Served, body: dict) -> list[requests.Response]:
    """Two streams on each replica, opened one at a time (each returns once its headers name
    its replica). Ray's router may send several in a row to the same replica (all of them, until
    its proxy has heard of the second one): a stream past two on a replica is closed at once."""
    url = served.url + "/v1/completions"
    opened: list[requests.Response] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        r = requests.post(url, json=body, headers=AUTH, stream=True, timeout=120)
        assert r.status_code == 200, r.text
        replicas = [o.headers["x-smcspec-replica"] for o in opened]
        if replicas.count(r.headers["x-smcspec-replica"]) >= 2:
            r.close()
            time.sleep(0.5)
            continue
        opened.append(r)
        if len(opened) == 4:
            return opened
    pytest.fail(f"Ray's router sent every stream for 60 s to the same replica: {replicas}")
