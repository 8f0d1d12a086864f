"""What a hostile or careless client cannot do: hold work after hanging up, send bodies past the
limit, ask for unbounded choices or text, stall the event loop, or crash the server with bad
text. Every bad request gets a 4xx in OpenAI's error shape, naming the field."""

import contextlib
import json
import socket
import threading
import time

import pytest
import requests

from smcspec.server.bodies import BodyReader
from smcspec.server.schema import MAX_MESSAGES, MAX_TOTAL_CHOICES
from tests.server.conftest import MODEL

LONG = {"max_tokens": 100, "ignore_eos": True, "method": "smc", "particles": 16, "n": 4}


def until(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def post_raw(url: str, path: str, body: bytes) -> socket.socket:
    """A request sent on a raw socket, its response never read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_a_non_streaming_client_that_hangs_up_frees_its_pages(served):
    pages, scheduler = served.llm.target.pages, served.server.scheduler
    served.wait_idle()
    body = json.dumps({"model": MODEL, "prompt": "w1 w2", **LONG}).encode()
    sock = post_raw(served.url, "/v1/completions", body)
    try:
        assert until(lambda: scheduler.running > 0 and pages.used_pages > 0, 10)
    finally:
        sock.close()
    assert until(lambda: pages.used_pages == 0 and scheduler.running == 0, 1.0), (
        f"{pages.used_pages} pages still held a second after the client hung up"
    )


def test_a_body_over_the_limit_is_refused_before_parsing(served):
    limit = served.server.defaults.http.max_body_bytes
    junk = b"{" * (limit + 1)  # malformed JSON: parsed, it would be a 400
    resp = requests.post(served.v1 + "/completions", data=junk, timeout=30)
    assert resp.status_code == 413, resp.text
    assert str(limit) in resp.json()["error"]["message"]

    def chunks():  # no content-length: counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    resp = requests.post(served.v1 + "/completions", data=chunks(), timeout=30)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["w1"] * 2000}, "prompt"),
        ({"prompt": ["w1"] * 8, "n": 16}, "n"),
    ],
    ids=["2000-prompts", "8x16"],
)
def test_choices_per_request_are_capped(served, body, param):
    assert len(body["prompt"]) * body.get("n", 1) > MAX_TOTAL_CHOICES
    resp = requests.post(served.v1 + "/completions", json={"model": MODEL, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert str(MAX_TOTAL_CHOICES) in resp.json()["error"]["message"]


def test_text_far_past_the_context_is_refused_before_tokenizing(served, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(served.llm, "encode", refuse)
    monkeypatch.setattr(served.llm, "encode_messages", refuse)
    text = "w1 " * (100 * served.server.context_length)
    resp = requests.post(served.v1 + "/completions", json={"model": MODEL, "prompt": text})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    resp = requests.post(served.v1 + "/chat/completions", json=chat, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", '{"prompt": "w1 \\ud800"}', "prompt"),
        ("/completions", '{"prompt": ["w1", "w2 \\udfff"]}', "prompt.1"),
        ("/completions", b'{"prompt": "w1 \xff\xfe"}', "prompt"),
        ("/completions", '{"prompt": "w1", "stop": ["\\ud800"]}', "stop.0"),
        (
            "/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
    ids=["surrogate", "in-list", "bad-utf8", "stop", "message", "message-part"],
)
def test_text_that_is_not_unicode_is_a_400_naming_the_field(served, path, body, param):
    raw = body if isinstance(body, bytes) else body.encode()
    raw = raw.replace(b"{", b'{"model": "' + MODEL.encode() + b'", ', 1)
    headers = {"content-type": "application/json"}
    resp = requests.post(served.v1 + path, data=raw, headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "Unicode" in error["message"], error


def test_health_answers_while_a_large_request_is_parsed(served, monkeypatch):
    """A body under the limit whose parsing and checking take a while (the most messages, each
    long, refused in the end for the context) is parsed off the event loop: the parse is held
    until /health has answered, which it can only do if the loop is free. (How long the parse
    holds the GIL is a speed, for benchmarks; this checks where it runs.)"""
    messages = [{"role": "user", "content": "w1 " * 250}] * MAX_MESSAGES
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    assert len(body) < served.server.defaults.http.max_body_bytes
    parsing, answered, seen = threading.Event(), threading.Event(), []
    parse = BodyReader.parse

    def held(self, raw, model):
        if len(raw) == len(body):
            parsing.set()
            seen.append(answered.wait(timeout=30))
        return parse(self, raw, model)

    monkeypatch.setattr(BodyReader, "parse", held)
    status = []

    def big() -> None:
        headers = {"content-type": "application/json"}
        r = requests.post(served.v1 + "/chat/completions", data=body, headers=headers, timeout=120)
        status.append(r.status_code)

    thread = threading.Thread(target=big)
    thread.start()
    assert parsing.wait(timeout=60), "the large request never reached its parse"
    assert requests.get(served.url + "/health", timeout=10).status_code == 200
    answered.set()
    thread.join(timeout=120)
    assert seen == [True] and status == [400]


@pytest.fixture(scope="module")
def impatient(tiny_llm):
    """A second server whose clients get one second to send a request."""
    from smcspec.config import HTTPLimits
    from smcspec.server.app import ServeDefaults
    from tests.server.conftest import serve

    handle, server, thread = serve(
        tiny_llm, ServeDefaults(MODEL, http=HTTPLimits(read_timeout=1.0))
    )
    yield handle
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
    ],
    ids=["nothing", "half-headers", "half-body"],
)
def test_a_client_that_stalls_mid_request_is_cut_off(impatient, sent):
    host, port = impatient.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""  # closed by the server, with nothing to say
        assert time.monotonic() - start < 5, "held past the read timeout of 1 s"


def test_health_reports_a_dead_scheduler_as_degraded(served, monkeypatch):
    from types import SimpleNamespace

    dead = SimpleNamespace(alive=False, running=0, queued=0)
    monkeypatch.setattr(served.server, "scheduler", dead)
    resp = requests.get(served.url + "/health", timeout=10)
    assert resp.status_code == 503
    assert resp.json()["status"] == "degraded" and resp.json()["scheduler_alive"] is False
