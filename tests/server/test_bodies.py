"""Bodies a careless or hostile client sends: nested past any use, numbers past Python's digit
limit, values of the wrong type, heads past the header cap, bodies it never finishes, streams it
never reads. Each is a 4xx (or a closed connection) with at most one log line, never a 500 with a
traceback, and nothing is held after."""

import contextlib
import json
import logging
import random
import socket
import time

import pytest
import requests
from pydantic import ValidationError

from smcspec.bench.serving import parse_metrics
from smcspec.config import HTTPLimits
from smcspec.server import bodies
from smcspec.server.api_error import ApiError
from smcspec.server.app import ServeDefaults
from smcspec.server.bodies import BodyReader, count_values, nests_past
from smcspec.server.connection import MAX_HEADER_BYTES, MAX_HEADERS
from smcspec.server.schema import ChatRequest, CompletionRequest, DetokenizeRequest
from tests.server.conftest import MODEL, serve
from tests.server.test_limits import until

DEEP = 100_000  # levels: far past Python's recursion limit
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def logs():
    """What uvicorn and smcspec log while the test runs (uvicorn's loggers do not propagate)."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "smcspec")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def strict_server(tiny_llm):
    """A server whose clients get half a second to send a request and to read a stream, and
    its uvicorn server."""
    defaults = ServeDefaults(
        MODEL, max_tokens=16, http=HTTPLimits(read_timeout=0.5, write_timeout=0.5)
    )
    handle, server, thread = serve(tiny_llm, defaults)
    # Accepted sockets inherit the listener's send buffer: a small one (no autotuning) fills with
    # a few KB, where the loopback's would take megabytes before uvicorn's buffer backs up.
    server.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    yield handle, server
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def strict(strict_server):
    return strict_server[0]


def statuses(served) -> dict[str, float]:
    """Requests counted by status, all routes together."""
    out: dict[str, float] = {}
    for key, value in parse_metrics(served.server.metrics.render().decode()).items():
        if key.startswith("smcspec:http_requests_total{"):
            status = key.split('status="')[1].split('"')[0]
            out[status] = out.get(status, 0) + value
    return out


def disconnects(served, stage: str) -> float:
    values = parse_metrics(served.server.metrics.render().decode())
    key = f'smcspec:client_disconnects_total{{model_name="{MODEL}",stage="{stage}"}}'
    return values.get(key, 0.0)


def post(served, path: str, raw: bytes) -> requests.Response:
    headers = {"content-type": "application/json"}
    return requests.post(served.url + path, data=raw, headers=headers, timeout=60)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def tool_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


MALFORMED = {
    "deep-body": lambda route: nested(DEEP),
    "deep-field": lambda route: b'{"model": "tiny", "prompt": ' + nested(DEEP) + b"}",
    # few values enough to be decoded, deep enough to pass Python's recursion limit
    "5000-deep-field": lambda route: b'{"model": "tiny", "prompt": ' + nested(5000) + b"}",
    "huge-int": lambda route: b'{"model": "tiny", "prompt": "w1", "seed": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", list(MALFORMED))
def test_json_nested_past_any_use_or_with_huge_numbers_is_a_400(served, logs, route, kind):
    before = statuses(served).get("500", 0)
    resp = post(served, route, MALFORMED[kind](route))
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "Error" not in error["message"], error
    assert statuses(served).get("500", 0) == before
    assert not [r for r in logs.records if r.exc_info], logs.lines()


def test_a_tool_schema_nested_past_the_depth_limit_is_a_400_naming_tools(served, logs):
    tools = [{"type": "function", "function": {"name": "f", "parameters": tool_schema(900)}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "tools": tools}
    resp = post(served, "/v1/chat/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["param"] == "tools", resp.json()
    assert not [r for r in logs.records if r.exc_info], logs.lines()


def test_a_schema_nested_as_deep_as_real_ones_still_works(served):
    """The depth limit leaves room: a response_format 20 arrays deep is decoded and planned."""
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": tool_schema(20)}}
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 2, "response_format": fmt}
    resp = post(served, "/v1/completions", json.dumps(body).encode())
    assert resp.status_code != 500 and "nest" not in resp.text, resp.text[:300]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", "5"),
        ("stream", "true"),
        ("n", True),
        ("seed", 1.0),
        ("max_tokens", "4"),
        ("temperature", "0.5"),
        ("echo", 1),
        ("logit_bias", {"5": True}),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_coerced(served, field, value):
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 2, field: value}
    resp = post(served, "/v1/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["param"].split(".")[0] == field, resp.json()


def test_a_logit_bias_key_that_is_not_an_ascii_number_gets_a_clear_message(served):
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 2, "logit_bias": {"\u00b2": 1}}
    resp = post(served, "/v1/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text
    assert "'\u00b2' is not a token id" in resp.json()["error"]["message"], resp.json()


@pytest.mark.parametrize("key", ["5" * 5000, " 5"], ids=["5000-digits", "space-5"])
def test_a_logit_bias_key_past_the_digits_or_not_bare_digits_is_a_400(served, key):
    """A key of 5,000 digits was a 500 (int() past Python's digit limit), and " 5" was taken as
    token 5. Both are 400s naming logit_bias."""
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 2, "logit_bias": {key: 1}}
    resp = post(served, "/v1/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == "logit_bias" and "is not a token id" in error["message"], error


# -- bounded work -----------------------------------------------------------------------------


def marks(data) -> int:
    """Commas and opening brackets in `data`'s JSON, outside its strings."""
    if isinstance(data, list | dict):
        items = data.values() if isinstance(data, dict) else data
        return 1 + max(len(data) - 1, 0) + sum(marks(x) for x in items)
    return 0


def random_json(rng: random.Random, depth: int = 0):
    tricky = [",", "[", "{", '"', "\\", "\\,", "\u00e9", "]", ":"]
    roll = rng.random()
    if depth < 4 and roll < 0.3:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 4 and roll < 0.5:
        return {"".join(rng.choices(tricky, k=2)): random_json(rng, depth + 1) for _ in range(3)}
    if roll < 0.8:
        return "".join(rng.choices([*tricky, "a", " "], k=rng.randrange(6)))
    return rng.choice([0, -1.5, True, None, 12345])


def test_values_are_counted_exactly_where_the_limit_is_decided():
    """Against a count over the decoded JSON: a body is over the limit exactly when its values
    are, whatever commas, brackets, quotes and backslashes its strings hold."""
    rng = random.Random(0)
    for _ in range(500):
        data = random_json(rng)
        raw = json.dumps(data, ensure_ascii=rng.random() < 0.5).encode()
        exact = 1 + marks(data)
        assert count_values(raw, 10**9) >= exact  # the cheap count never undercounts
        for limit in (exact - 1, exact):
            assert (count_values(raw, limit) > limit) == (exact > limit), (raw, limit)


def test_nesting_is_measured_in_levels_of_arrays_and_objects():
    assert not nests_past(json.loads(nested(64)), 64)
    assert nests_past(json.loads(nested(65)), 64)
    assert not nests_past([[1, "[[["], {"a": [2]}], 3)
    assert nests_past([[1], {"a": [{}]}], 3)
    assert not nests_past("[[[[", 0)


def test_a_body_with_more_values_than_the_context_needs_is_refused_before_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoded a body over the limit")

    monkeypatch.setattr(bodies.json, "loads", refuse)
    reader = BodyReader(context_length=128)
    raw = json.dumps({"model": MODEL, "prompt": [5] * (reader.max_values + 1)}).encode()
    with pytest.raises(ApiError, match="JSON values"):
        reader.load(raw)
    text = json.dumps({"model": MODEL, "prompt": "w1, [{" * reader.max_values}).encode()
    with pytest.raises(AssertionError, match="decoded"):  # commas in text do not count
        reader.load(text)


@pytest.mark.parametrize(
    ("model", "field", "items"),
    [
        (CompletionRequest, "prompt", [None] * 1000),
        (CompletionRequest, "logit_bias", dict.fromkeys(map(str, range(1000)))),
        (ChatRequest, "messages", [None] * 1000),
        (DetokenizeRequest, "tokens", ["w1"] * 1000),
    ],
)
def test_a_collection_stops_at_its_first_bad_item(model, field, items):
    """Not one error an item: each costs microseconds with the GIL held."""
    body = {"model": MODEL, "prompt": "w1", "messages": [], "tokens": [1], field: items}
    body = {k: v for k, v in body.items() if k in model.model_fields}
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    assert caught.value.error_count() <= 3, caught.value.error_count()  # one per union member


def test_tokenize_caps_text_as_completions_do(served, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(served.llm.tokenizer, "encode", refuse)
    text = "w1 " * (100 * served.server.context_length)
    for body, param in (
        ({"prompt": text}, "prompt"),
        ({"messages": [{"role": "user", "content": text}]}, "messages"),
    ):
        resp = post(served, "/tokenize", json.dumps({"model": MODEL, **body}).encode())
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# -- the head ---------------------------------------------------------------------------------


def exchange(url: str, data: bytes, pieces: int = 1) -> bytes:
    """The response's status line to `data`, sent in one write (or `pieces` writes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        step = -(-len(data) // pieces)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused mid-head
            for start in range(0, len(data), step):
                sock.sendall(data[start : start + step])
                if pieces > 1:
                    time.sleep(0.01)
        with contextlib.suppress(ConnectionResetError):
            return sock.recv(65536).split(b"\r\n", 1)[0]
    return b""


def head(target: str = "/health", headers: list[tuple[str, str]] = ()) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "host: x", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


HEADS = {
    "60KB-header": head(headers=[("x-big", "a" * 60_000)]),
    "100KB-url": head("/health?" + "a" * 100_000),
    "2000-headers": head(headers=[(f"x-h{i}", "v") for i in range(2000)]),
    "150-small-headers": head(headers=[(f"h{i}", "") for i in range(150)]),  # 1 KB
}


@pytest.mark.parametrize("pieces", [1, 8], ids=["one-write", "pieces"])
@pytest.mark.parametrize("kind", list(HEADS))
def test_heads_over_the_header_cap_get_431(served, kind, pieces):
    status = exchange(served.url, HEADS[kind], pieces)
    assert status.startswith(b"HTTP/1.1 431 "), status


def test_heads_under_the_cap_are_served(served):
    room = MAX_HEADER_BYTES - 200
    assert exchange(served.url, head(headers=[("x-big", "a" * room)])) == b"HTTP/1.1 200 OK"
    many = [(f"x-h{i}", "v") for i in range(MAX_HEADERS - 2)]
    assert exchange(served.url, head(headers=many)) == b"HTTP/1.1 200 OK"


# -- hang-ups ---------------------------------------------------------------------------------


def half_body(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"model": "tiny", '
    )
    return sock


@pytest.mark.parametrize("who", ["client", "read-timeout"])
def test_a_hang_up_mid_body_is_a_client_disconnect_with_one_log_line(strict, logs, who):
    """The client closes its connection halfway through the body, or stalls there until the
    read timeout closes it: counted as a 499 and a disconnect, never a 500 or a traceback."""
    before, cut = statuses(strict), disconnects(strict, "body")
    sock = half_body(strict.url)
    if who == "client":
        time.sleep(0.1)  # the request has reached the app, which waits for the rest
        sock.close()
    else:
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""  # closed by the server after 0.5 s
        sock.close()
    assert until(lambda: disconnects(strict, "body") == cut + 1, 5), statuses(strict)
    after = statuses(strict)
    assert after.get("499", 0) == before.get("499", 0) + 1, after
    assert after.get("500", 0) == before.get("500", 0), after
    assert not [r for r in logs.records if r.exc_info], logs.lines()
    assert len(logs.lines()) == 1 and "hung up" in logs.lines()[0], logs.lines()


def test_a_stream_whose_client_never_reads_is_dropped_after_the_write_timeout(strict_server):
    """A client that asks for a long stream and never reads it: once the socket buffers are full
    the server waits `write_timeout` (0.5 s here), then drops the connection and what it had
    left to send (without a timeout it held both until the client read)."""
    strict, uv = strict_server
    connections = uv.server_state.connections
    before = set(connections)
    body = {
        "model": MODEL,
        "prompt": "w1",
        "max_tokens": 100,
        "n": 4,
        "ignore_eos": True,
        "method": "ar",
        "stream": True,
        "logprobs": 20,
        "echo": True,
    }
    raw = json.dumps(body).encode()
    host, port = strict.url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        assert until(lambda: len(connections - before) == 1, 5)
        assert until(lambda: not connections - before, 20), "the stream's connection is held"
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                received += chunk
    assert b"data: [DONE]" not in received, "the whole stream was kept for the client"
