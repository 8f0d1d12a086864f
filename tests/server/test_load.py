"""Many concurrent clients on one server: all finish, requests share forward passes, and the KV
pages return to idle, also when half of the streaming clients hang up midway."""

import json
import threading

import requests

from tests.server.conftest import MODEL

CLIENTS = 32
METHODS = [
    {"method": "ar"},
    {"method": "sd", "draft_tokens": 3},
    {"method": "smc", "particles": 4, "draft_tokens": 2},
    {"method": "smc", "particles": 2, "draft_tokens": 4},
]


def client(served, i: int, outcomes: dict) -> None:
    """Client i: streams when i is even; every other streaming client (i % 4 == 0) hangs up
    after its first text, on a long request that is still running then."""
    stream, hang_up = i % 2 == 0, i % 4 == 0
    body = {
        "model": MODEL,
        "prompt": f"w{i % 50} w{(7 * i) % 50} w3",
        "max_tokens": 100 if hang_up else 10,
        "seed": i,
        "stream": stream,
        "ignore_eos": True,
        **METHODS[i % len(METHODS)],
    }
    if hang_up:
        body.update(method="ar")  # streams from its first token, so it is cut midway
    try:
        with requests.post(served.v1 + "/completions", json=body, stream=stream, timeout=120) as r:
            if r.status_code != 200:
                outcomes[i] = f"HTTP {r.status_code}: {r.text[:200]}"
            elif not stream:
                outcomes[i] = "ok" if r.json()["choices"][0]["text"] else "empty"
            else:
                outcomes[i] = read_stream(r, hang_up)
    except Exception as err:  # recorded: the test asserts on every outcome
        outcomes[i] = f"{type(err).__name__}: {err}"


def read_stream(r, hang_up: bool) -> str:
    text = ""
    for line in r.iter_lines(decode_unicode=True):
        if not line:
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return "ok" if text else "empty"
        text += json.loads(data)["choices"][0]["text"]
        if hang_up and text:
            return "hung up"  # leaving the `with` closes the connection
    return "no [DONE]"


def test_concurrent_clients_all_finish_and_pages_return_to_idle(served):
    scheduler = served.server.scheduler
    forwards0, rows0 = scheduler.stats.forwards[0], scheduler.stats.rows[0]
    cancelled0 = scheduler.stats.cancelled
    outcomes: dict[int, str] = {}
    threads = [threading.Thread(target=client, args=(served, i, outcomes)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    expected = {i: "hung up" if i % 4 == 0 else "ok" for i in range(CLIENTS)}
    assert outcomes == expected
    served.wait_idle()
    assert scheduler.running == 0 and scheduler.queued == 0
    assert served.llm.target.pages.used_pages == 0
    assert served.llm.draft.pages.used_pages == 0
    hung_up = CLIENTS // 4
    assert scheduler.stats.cancelled - cancelled0 == hung_up, "hung-up requests must stop"
    forwards = scheduler.stats.forwards[0] - forwards0
    rows = scheduler.stats.rows[0] - rows0
    assert rows / forwards > 4, f"{rows} rows in {forwards} target passes: too little batching"


def test_requests_queue_for_kv_pages_and_all_complete(tiny_llm):
    """A pool of 40 pages of 4 positions holds one smc request (N = 4) at a time: the others
    wait in the queue (seen in /health), then every one completes and the pool is idle."""
    from smcspec import LLM
    from smcspec.models.native import NativeCausalLM
    from smcspec.server.app import ServeDefaults
    from tests.server.conftest import serve

    def small(m):
        return NativeCausalLM(m.model, set(m.eos_token_ids), num_pages=40, page_size=4)

    llm = LLM.from_models(small(tiny_llm.target), small(tiny_llm.draft), tiny_llm.tokenizer)
    handle, server, thread = serve(
        llm, ServeDefaults(MODEL, method="smc", particles=4, draft_tokens=3)
    )
    try:
        body = {"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": 20, "ignore_eos": True}
        outcomes: dict[int, str] = {}
        queued: list[int] = []

        def one(i: int) -> None:
            r = requests.post(handle.v1 + "/completions", json={**body, "seed": i}, timeout=120)
            outcomes[i] = (
                "ok" if r.status_code == 200 and r.json()["choices"][0]["text"] else r.text
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            queued.append(requests.get(handle.url + "/health", timeout=30).json()["queued"])
        for t in threads:
            t.join(timeout=120)
        assert outcomes == dict.fromkeys(range(6), "ok")
        assert max(queued) >= 1
        handle.wait_idle()
        assert llm.target.pages.used_pages == 0 and llm.draft.pages.used_pages == 0
        too_big = {**body, "particles": 16, "max_tokens": 60}
        r = requests.post(handle.v1 + "/completions", json=too_big, timeout=30)
        assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
