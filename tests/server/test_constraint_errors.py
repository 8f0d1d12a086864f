"""A constraint llguidance gives up on, over HTTP (issue 25): a 400 naming the field before any
decoding when the probe sees it; a 400 (or, streaming, an error event before [DONE]) when a
decode reaches it; never a 200 "stop" whose text breaks the constraint. And under load: the
failing requests fail alone, the others complete with the text they get alone, and the server
gives everything back.

On a tiny random model with one token per byte and tool-call tokens (tests/server/test_tools.py).
`logit_bias` +100 on "y" steers a decode into the branch of `EVADER` that the probe (which walks
the lowest token id, "x") does not take."""

import json
import threading

import pytest
import requests

from smcspec.server.app import ServeDefaults
from tests.server.test_limits import until
from tests.server.test_tools import serve_byte_pair

MODEL = "tiny-bytes"
BOMBS = ["^a{1000000}$", "^((a{100}){100}){100}$"]  # llguidance gives up at the first "a"
EVADER = "^(x|ya{1000000})$"
MESSAGES = [{"role": "user", "content": "hi"}]


def with_pattern(pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
        "additionalProperties": False,
    }


def tool(pattern: str) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": with_pattern(pattern)}}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_byte_pair(tmp_path_factory, ServeDefaults(MODEL, particles=3, max_tokens=48))


def towards_y(served) -> dict:
    (y,) = served.llm.tokenizer.encode("y", add_special_tokens=False)
    return {"logit_bias": {str(y): 100}}


def chat(served, **extra) -> requests.Response:
    body = {"model": MODEL, "messages": MESSAGES, "seed": 0, **extra}
    return requests.post(served.v1 + "/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("pattern", BOMBS)
@pytest.mark.parametrize("field", ["tools", "response_format"])
def test_a_schema_llguidance_gives_up_on_is_a_400_naming_the_field(served, field, pattern):
    """Before: 200, finish_reason "stop", a text of whitespace and free bytes (no tool_calls)."""
    if field == "tools":
        r = chat(served, tools=[tool(pattern)], tool_choice="required")
    else:
        r = chat(served, response_format=response_format(with_pattern(pattern)))
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and "too complex" in error["message"], error
    assert repr(pattern) in error["message"]


def dead_end(served, field: str, method: str, **extra) -> requests.Response:
    if field == "tools":
        shape = {"tools": [tool(EVADER)], "tool_choice": "required"}
    else:
        shape = {"response_format": response_format({"type": "string", "pattern": EVADER})}
    return chat(served, method=method, **shape, **towards_y(served), **extra)


@pytest.mark.parametrize("method", ["smc", "ar"])
@pytest.mark.parametrize("field", ["tools", "response_format"])
def test_a_decode_where_llguidance_gives_up_is_a_400_not_a_stop(served, field, method):
    """Before: 200, finish_reason "stop", content '<tool_call>\\n{"name": "f", "arguments":
    {"s": "y' (or '"y'), no tool_calls."""
    r = dead_end(served, field, method)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "no output can satisfy" in message and "llguidance gave up" in message, message


def events(response: requests.Response) -> list:
    out = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("field", ["tools", "response_format"])
def test_a_stream_that_makes_llguidance_give_up_ends_with_an_error_event(served, field):
    with dead_end(served, field, "smc", stream=True) as r:
        assert r.status_code == 200  # the head went out before the decode began
        got = events(r)
    assert got[-1] == "[DONE]"
    assert "llguidance gave up" in got[-2]["error"]["message"], got[-2]
    reasons = [c["finish_reason"] for e in got[:-2] for c in e["choices"]]
    assert set(reasons) == {None}, reasons  # no "stop" before the error


GOOD_SCHEMA = {"enum": ["ab", "cd", "xyz"]}


def good(i: int) -> dict:
    stream = i % 2 == 1
    return {"response_format": response_format(GOOD_SCHEMA), "seed": i, "stream": stream}


def outcome(served, body: dict) -> tuple[int, str]:
    """(status, the text) or, for an error, (status, its message); a stream's error event
    counts as a 400."""
    stream = body.get("stream", False)
    with chat(served, **body) as r:
        if r.status_code != 200:
            return r.status_code, r.json()["error"]["message"]
        if not stream:
            return 200, r.json()["choices"][0]["message"]["content"]
        got = events(r)
    if "error" in got[-2]:
        return 400, got[-2]["error"]["message"]
    return 200, "".join(c["delta"].get("content") or "" for e in got[:-1] for c in e["choices"])


def test_requests_llguidance_gives_up_on_fail_alone_under_load(served):
    """Six good constrained requests beside four that llguidance gives up on (two at run time,
    one streamed; two refused up front), all at once."""
    pages = served.llm.target.pages, served.llm.draft.pages
    scheduler = served.server.scheduler
    bodies = [good(i) for i in range(6)]
    alone = [outcome(served, b) for b in bodies]
    assert all(s == 200 and json.loads(t) in GOOD_SCHEMA["enum"] for s, t in alone), alone
    bad = [
        {**b, "method": "smc", **towards_y(served)}
        for b in (
            {"response_format": response_format({"type": "string", "pattern": EVADER})},
            {"tools": [tool(EVADER)], "tool_choice": "required", "stream": True},
            {"tools": [tool(BOMBS[0])], "tool_choice": "required"},
            {"response_format": response_format(with_pattern(BOMBS[1])), "stream": True},
        )
    ]
    results: dict[int, tuple[int, str]] = {}

    def one(i: int, body: dict) -> None:
        results[i] = outcome(served, body)

    threads = [threading.Thread(target=one, args=ib) for ib in enumerate(bodies + bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert [results[i] for i in range(len(bodies))] == alone
    for i in range(len(bodies), len(bodies) + len(bad)):
        status, message = results[i]
        assert status == 400 and "llguidance" in message, (i, results[i])
    assert until(lambda: scheduler.running == 0 and scheduler.queued == 0, 10)
    assert until(lambda: all(p.used_pages == 0 for p in pages), 5)
    assert requests.get(served.url + "/health", timeout=10).json()["scheduler_alive"] is True
