"""`--api-key` / $SMCSPEC_API_KEY: every route but /health needs `Authorization: Bearer KEY`,
checked before the body is read, and the key never shows in a response or a log line."""

import os
import socket
import subprocess
import sys
from urllib.parse import urlparse

import openai
import pytest
import requests
from openai import OpenAI

from smcspec.bench.serving import free_port, wait_ready
from smcspec.cli import main
from smcspec.server.app import ServeDefaults
from tests.server.conftest import MODEL, serve

KEY = "sk-test-3f9c1a7e"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "w1"}]},
    ),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "w1 w2"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [4, 5]}),
]
WRONG = [
    {},
    {"Authorization": "Bearer sk-wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
]


@pytest.fixture(scope="module")
def keyed(tiny_llm):
    defaults = ServeDefaults(MODEL, particles=4, draft_tokens=3, max_tokens=8, api_key=KEY)
    handle, server, thread = serve(tiny_llm, defaults)
    yield handle
    server.should_exit = True
    thread.join(timeout=30)


def call(served, method: str, path: str, body, headers: dict) -> requests.Response:
    return requests.request(method, served.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=lambda x: str(x)[:20])
def test_every_route_but_health_needs_the_key(keyed, method, path, body):
    for headers in WRONG:
        r = call(keyed, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "invalid_api_key",
            None,
        )
        assert r.headers["www-authenticate"] == "Bearer"
        assert KEY not in r.text and KEY[:-1] not in r.text
    r = call(keyed, method, path, body, AUTH)
    assert r.status_code == 200, r.text
    assert KEY not in r.text


def test_health_answers_without_the_key_and_never_shows_it(keyed):
    r = requests.get(keyed.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert KEY not in r.text
    assert KEY not in repr(keyed.server.defaults)


def test_the_openai_client_with_the_key_and_with_a_wrong_one(keyed):
    good = OpenAI(base_url=keyed.v1, api_key=KEY, max_retries=0, timeout=60)
    out = good.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=4, seed=0
    )
    assert out.choices[0].message.content is not None
    assert out.usage.prompt_tokens == 2
    bad = OpenAI(base_url=keyed.v1, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_the_key_is_checked_before_the_body_is_read(keyed):
    """Headers announcing a body that never comes: without the key the answer is a 401 at once,
    not a wait for the body (the read timeout is 10 s)."""
    url = urlparse(keyed.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(head.encode())
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 401 Unauthorized"


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "tab\tkey"])
def test_a_key_clients_cannot_send_is_refused_without_echoing_it(key, capsys):
    with pytest.raises(ValueError, match="api_key") as caught:
        ServeDefaults(MODEL, api_key=key)
    assert key == "" or key not in str(caught.value)
    assert main(["serve", "--api-key", key, "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "api_key" in err and "nonexistent" not in err
    assert key == "" or key not in err


def test_serve_reads_the_key_from_the_environment_and_never_logs_it(
    tiny_llama_folder, tiny_llama_draft_folder
):
    port = free_port()
    cmd = [sys.executable, "-m", "smcspec", "serve", "--port", str(port), "--model-name", MODEL]
    cmd += ["--target", str(tiny_llama_folder), "--draft", str(tiny_llama_draft_folder)]
    cmd += ["--dtype", "float32"]
    env = {**os.environ, "SMCSPEC_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=120)
        assert requests.get(url + "/v1/models", timeout=10).status_code == 401
        assert requests.get(url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
        bad = {"model": MODEL, "prompt": "w1", "frobnicate": 1}
        r = requests.post(url + "/v1/completions", json=bad, headers=AUTH, timeout=10)
        assert r.status_code == 400 and KEY not in r.text
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0].decode()
    assert "API key required" in output
    assert KEY not in output


def test_the_flag_wins_over_the_environment(monkeypatch):
    from smcspec.cli import build_parser
    from smcspec.cli.serve import _api_key

    parser = build_parser()
    monkeypatch.setenv("SMCSPEC_API_KEY", "from-env")
    assert _api_key(parser.parse_args(["serve"])) == "from-env"
    assert _api_key(parser.parse_args(["serve", "--api-key", "from-flag"])) == "from-flag"
    monkeypatch.setenv("SMCSPEC_API_KEY", "")
    assert _api_key(parser.parse_args(["serve"])) is None
    monkeypatch.delenv("SMCSPEC_API_KEY")
    assert _api_key(parser.parse_args(["serve"])) is None
