"""`smcspec serve` as a user starts it: a subprocess on a free port, then the openai client."""

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from openai import OpenAI

from smcspec.bench.serving import free_port, wait_ready
from smcspec.cli import main


def test_serve_command_answers_the_openai_client(tiny_llama_folder, tiny_llama_draft_folder):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "smcspec",
        "serve",
        "--port",
        str(port),
        "--target",
        str(tiny_llama_folder),
        "--draft",
        str(tiny_llama_draft_folder),
        "--dtype",
        "float32",
        "--model-name",
        "tiny-pair",
        "--method",
        "sd",
        "--max-tokens",
        "6",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_ready(url, proc, timeout=120)["model"] == "tiny-pair"
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model="tiny-pair", messages=[{"role": "user", "content": "w1 w2"}], seed=0
        )
        assert out.choices[0].message.content
        assert out.usage.completion_tokens <= 6  # the server's --max-tokens default
        assert out.choices[0].smcspec["method"] == "sd"  # the server's --method default
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--port", "70000", "--port"),
        ("--particles", "0", "particles"),
        ("--particles", "65", "particles"),
        ("--device", "cuda:99", "cuda:99"),
        ("--temperature", "-1", "temperature"),
        ("--max-running", "0", "max_running"),
        ("--max-batch-tokens", "0", "max_batch_tokens"),
        ("--write-timeout", "0", "write_timeout"),
        ("--replicas", "0", "--replicas"),
        ("--autoscale", "3:1", "--autoscale"),
        ("--autoscale", "two", "--autoscale"),
        ("--replica-cpus", "0", "--replica-cpus"),
        ("--replica-gpus", "-1", "--replica-gpus"),
        ("--ray-address", "nowhere", "--ray-address"),
        ("--target-ongoing", "4", "--autoscale"),
    ],
)
def test_serve_rejects_bad_settings_before_loading_anything(flag, value, named):
    """The default models are not even looked for: the error comes at once."""
    out = subprocess.run(
        [sys.executable, "-m", "smcspec", "serve", flag, value, "--target", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert named in out.stderr and "nonexistent" not in out.stderr


def test_request_defaults_are_the_engines_resolved_per_request():
    """A request that names no method gets auto (exact unless it says approximate), with room
    for auto's largest K; one with a potential gets auto too; one naming sd gets sd's K."""
    from smcspec import LLM, AutoConfig
    from smcspec.models.toy import perturbed_lm, random_lm
    from smcspec.server.runtime import ServeDefaults, Server
    from smcspec.server.schema import CompletionRequest

    target = random_lm(5, seed=1)
    server = Server(LLM.from_models(target, perturbed_lm(target, 2, 0.5)), ServeDefaults("m"))
    try:
        (auto,) = server.plan(CompletionRequest(model="m", prompt=[1, 2]), [[1, 2]], "prompt")
        assert (auto.plan.decoding, auto.plan.max_length()) == (AutoConfig(), 2 + 128 + 8)
        body = CompletionRequest(model="m", prompt=[1, 2], approximate=True)
        (approximate,) = server.plan(body, [[1, 2]], "prompt")
        assert approximate.plan.decoding == AutoConfig(exact=False)
        body = CompletionRequest(model="m", prompt=[1, 2], power_alpha=2.0)
        (smc,) = server.plan(body, [[1, 2]], "prompt")
        assert smc.plan.decoding == AutoConfig() and smc.plan.potential is not None
        body = CompletionRequest(model="m", prompt=[1, 2], method="sd")
        (sd,) = server.plan(body, [[1, 2]], "prompt")
        assert (sd.plan.decoding.draft_tokens, sd.plan.max_length()) == (4, 2 + 128 + 4)
    finally:
        server.shutdown()


def start(target, draft, port: int, *options: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "smcspec", "serve", "--port", str(port), "--target", str(target)]
    cmd += ["--draft", str(draft), "--dtype", "float32", *options]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_model_id_is_the_folder_name_not_its_path(tiny_llama_folder, tiny_llama_draft_folder):
    port = free_port()
    proc = start(tiny_llama_folder, tiny_llama_draft_folder, port)
    try:
        url = f"http://127.0.0.1:{port}"
        health = wait_ready(url, proc, timeout=120)
        name = tiny_llama_folder.name
        assert (health["model"], health["target"]) == (name, name)
        assert health["draft"] == tiny_llama_draft_folder.name
        models = requests.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [name]
        bad = {"model": str(tiny_llama_folder), "prompt": "w1"}
        error = requests.post(url + "/v1/completions", json=bad, timeout=10).json()["error"]
        assert error["param"] == "model" and repr(name) in error["message"]
        assert str(tiny_llama_folder.parent) not in error["message"].replace(bad["model"], "")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


GRACE_S = 1.0
MARGIN_S = 6.0  # the app's CLOSE_S, the scheduler's unwinding and the interpreter's exit


def test_sigterm_cancels_running_requests_after_the_grace_period(
    tiny_llama_folder, tiny_llama_draft_folder
):
    """Two long requests (one streamed) still running at SIGTERM: after the grace period the
    waiting client gets a 503, the stream an error event, and the process exits."""
    port = free_port()
    options = ("--model-name", "tiny-pair", "--shutdown-timeout", str(GRACE_S))
    proc = start(tiny_llama_folder, tiny_llama_draft_folder, port, *options)
    url = f"http://127.0.0.1:{port}"
    long = {"model": "tiny-pair", "prompt": "w1 w2", "max_tokens": 100, "ignore_eos": True}
    long.update(method="smc", particles=16, n=8)
    outcomes: dict[str, object] = {}

    def plain() -> None:
        r = requests.post(url + "/v1/completions", json=long, timeout=120)
        outcomes["plain"] = (r.status_code, r.text)

    def streamed() -> None:
        body = {**long, "stream": True}
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]
        outcomes["stream"] = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]

    try:
        wait_ready(url, proc, timeout=120)
        clients = [threading.Thread(target=f) for f in (plain, streamed)]
        for t in clients:
            t.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            health = requests.get(url + "/health", timeout=10).json()
            if health["running"] + health["queued"] == 2 * long["n"]:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=GRACE_S + MARGIN_S + 30)
        took = time.monotonic() - sent
        for t in clients:
            t.join(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert took < GRACE_S + MARGIN_S, f"the server took {took:.1f} s to exit"
    status, text = outcomes["plain"]
    assert status == 503 and "shutting down" in json.loads(text)["error"]["message"], text
    errors = [e["error"]["message"] for e in outcomes["stream"] if "error" in e]
    assert errors and all("shutting down" in e for e in errors), outcomes["stream"][-3:]


def test_serve_names_an_unreachable_ray_cluster_in_one_line_before_loading_anything():
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "smcspec",
            "serve",
            "--ray-address",
            address,
            "--target",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and time.monotonic() - started < 30
    refused = f"--ray-address {address}: no Ray cluster answers there (Connection refused)"
    assert out.stderr.strip().splitlines() == [f"smcspec: error: {refused}"]


def test_replicas_without_ray_installed_say_how_to_get_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    assert main(["serve", "--replicas", "2", "--target", "/nonexistent"]) == 1
    assert capsys.readouterr().err == (
        "smcspec: error: replicas run on Ray Serve: pip install 'smcspec[ray]'\n"
    )
