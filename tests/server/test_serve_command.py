"""`smcspec serve` as a user starts it: a subprocess on a free port, then the openai client."""

import subprocess
import sys

import pytest
from openai import OpenAI

from smcspec.bench.serving import free_port, wait_ready


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
            model="tiny-pair", messages=[{"role": "user", "content": "w1 w2"}]
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
    """A request that names no method gets sd with sd's K; one with a potential gets smc with
    smc's own N and K; the lookahead kept free in the context is that method's K."""
    from smcspec import LLM
    from smcspec.models.toy import perturbed_lm, random_lm
    from smcspec.server.runtime import ServeDefaults, Server
    from smcspec.server.schema import CompletionRequest

    target = random_lm(5, seed=1)
    server = Server(LLM.from_models(target, perturbed_lm(target, 2, 0.5)), ServeDefaults("m"))
    try:
        (sd,) = server.plan(CompletionRequest(model="m", prompt=[1, 2]), [[1, 2]], "prompt")
        assert (sd.plan.method, sd.plan.sd.draft_tokens, sd.plan.max_length()) == ("sd", 4, 134)
        body = CompletionRequest(model="m", prompt=[1, 2], power_alpha=2.0)
        (smc,) = server.plan(body, [[1, 2]], "prompt")
        assert (smc.plan.method, smc.plan.smc.particles, smc.plan.smc.draft_tokens) == (
            "smc",
            2,
            8,
        )
    finally:
        server.shutdown()
