"""The server with the real `openai` client: completions, chat, streaming, settings, errors."""

import json

import openai
import pytest
import requests

from smcspec.bench.serving import parse_metrics
from smcspec.decoding.methods import method_row
from tests.server.conftest import MODEL

PROMPT = "w1 w2 w3"
SETTINGS = [
    {"method": "ar"},
    {"method": "sd", "draft_tokens": 2},
    {"method": "smc", "particles": 3, "draft_tokens": 2, "resampling": "multinomial"},
]


def offline(served, prompt, chat: bool, seed: int, max_tokens: int, **extra):
    """What `LLM.generate` gives for the same request (the server's defaults filled in where
    the method reads them, as the server fills them)."""
    reads = method_row(extra.get("method", "auto")).settings
    defaults = {k: v for k, v in {"particles": 4, "draft_tokens": 3}.items() if k in reads}
    settings = defaults | {"temperature": 1.0, **extra}
    return served.llm.generate(
        prompt, chat=chat, seed=seed, max_new_tokens=max_tokens, **settings
    ).text


def test_models_lists_the_served_model(served):
    assert [m.id for m in served.client().models.list()] == [MODEL]
    assert requests.get(served.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("extra", SETTINGS, ids=lambda s: s["method"])
def test_completion_is_what_generate_gives_for_the_same_seed(served, extra):
    out = served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=9, seed=11, extra_body=extra
    )
    choice = out.choices[0]
    assert choice.text == offline(served, PROMPT, False, 11, 9, **extra)
    assert choice.text.strip()
    assert out.usage.prompt_tokens == 3
    assert 1 <= out.usage.completion_tokens <= 9
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.smcspec["method"] == extra["method"]
    assert choice.smcspec["diagnostics"]["seed"] == 11


@pytest.mark.parametrize("extra", SETTINGS, ids=lambda s: s["method"])
def test_chat_applies_the_template_and_streams_the_same_text(served, extra):
    client = served.client()
    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, seed=5, extra_body=extra
    )
    text = out.choices[0].message.content
    expected_ids = served.llm.encode_messages(messages)
    assert expected_ids == served.llm.encode("w5 w1 w2", chat=False)
    assert text == offline(served, expected_ids, False, 5, 12, **extra)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, seed=5, stream=True, extra_body=extra
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == text
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_ar_and_sd_stream_token_by_token_and_end_with_done(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "seed": 2, "stream": True}
    for method in ("ar", "sd"):
        lines = sse_lines(served, "/completions", {**body, "method": method, "ignore_eos": True})
        assert lines[-1] == "[DONE]"
        deltas = [json.loads(x)["choices"][0]["text"] for x in lines[:-1]]
        assert sum(1 for d in deltas if d) >= 3, f"{method} must stream as tokens are accepted"


def test_smc_streams_only_the_particles_common_prefix(served):
    """With one particle the common prefix is the whole particle: smc streams every round."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": 2, "stream": True}
    body.update(method="smc", particles=1, draft_tokens=2, ignore_eos=True)
    deltas = [
        json.loads(x)["choices"][0]["text"] for x in sse_lines(served, "/completions", body)[:-1]
    ]
    assert sum(1 for d in deltas if d) >= 3
    full = requests.post(served.v1 + "/completions", json={**body, "stream": False}, timeout=60)
    assert "".join(deltas) == full.json()["choices"][0]["text"]


def test_stop_strings_cut_the_text_and_stop_early(served):
    client = served.client()
    for extra in SETTINGS:
        free = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, seed=3, extra_body=extra
        )
        words = free.choices[0].text.split()
        if len(words) < 3:
            continue
        stop = " " + words[2]
        cut = free.choices[0].text[: free.choices[0].text.index(stop)]
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            seed=3,
            stop=[stop, "never"],
            extra_body=extra,
        )
        assert out.choices[0].text == cut
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens < free.usage.completion_tokens
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            seed=3,
            stop=stop,
            stream=True,
            extra_body=extra,
        )
        assert "".join(c.choices[0].text for c in stream) == cut


def test_n_samples_are_independent_choices_with_their_own_seeds(served):
    out = served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, seed=40, n=3, extra_body={"method": "ar"}
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    seeds = [c.smcspec["diagnostics"]["seed"] for c in out.choices]
    assert seeds == [40, 41, 42]
    for c in out.choices:
        assert c.text == offline(
            served, PROMPT, False, c.smcspec["diagnostics"]["seed"], 8, method="ar"
        )


def test_particles_come_with_their_weights_on_request(served):
    out = served.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        seed=1,
        extra_body={"method": "smc", "particles": 5, "return_particles": True},
    )
    particles = out.choices[0].smcspec["particles"]
    assert len(particles) == 5
    assert sum(p["weight"] for p in particles) == pytest.approx(1.0)
    chosen = out.choices[0].smcspec["diagnostics"]["chosen_particle"]
    assert particles[chosen]["text"] == out.choices[0].text


BAD = [
    ({"prompt": PROMPT, "model": "gpt-4"}, "model"),
    ({"prompt": PROMPT, "particles": "many"}, "particles"),
    ({"prompt": PROMPT, "particles": 0}, "particles"),
    ({"prompt": PROMPT, "temperature": 7}, "temperature"),
    ({"prompt": PROMPT, "method": "beam"}, "method"),
    ({"prompt": PROMPT, "resample_threshold": 1.5}, "resample_threshold"),
    ({"prompt": PROMPT, "particle": 4}, "particle"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 500}, "max_tokens"),
    ({"prompt": " ".join(["w1"] * 130)}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, None),
    ({"prompt": PROMPT, "stop": ["a", ""]}, "stop"),
    ({"prompt": PROMPT, "stop": ""}, "stop"),
    ({"prompt": PROMPT, "method": "sd", "response_format": {"type": "json_object"}}, None),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ({"prompt": PROMPT, "n": 100}, "n"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_a_400_that_names_the_field(served, body, param):
    resp = requests.post(served.v1 + "/completions", json={"model": MODEL, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param


def test_a_body_cannot_say_exact_so_approximate_is_its_one_spelling(served):
    """`exact` and `approximate` given together must agree (tests/engine/
    test_exact_and_approximate.py); a body cannot give `exact` at all, so it cannot contradict."""
    body = {"model": MODEL, "prompt": PROMPT, "exact": True, "approximate": True}
    resp = requests.post(served.v1 + "/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "exact", resp.json()


@pytest.mark.parametrize(
    ("method", "draft_tokens"), [("sd", 100_000), ("smc", 2**62), ("msd", 128)]
)
def test_draft_tokens_that_fill_the_context_are_a_400_naming_draft_tokens(
    served, method, draft_tokens
):
    """The tiny model's context holds 128 positions: K draft tokens of lookahead >= 128 leave
    no room for any prompt. The 400 named `prompt`."""
    body = {"model": MODEL, "prompt": PROMPT, "method": method, "draft_tokens": draft_tokens}
    resp = requests.post(served.v1 + "/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "draft_tokens", resp.json()


def test_malformed_bodies_and_unknown_routes_get_json_errors(served):
    for data in ("{bad json", "", "[1, 2]", "null"):
        resp = requests.post(
            served.v1 + "/chat/completions",
            data=data,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert resp.status_code == 400, (data, resp.text)
        assert resp.json()["error"]["message"]
    resp = requests.get(served.v1 + "/nothing", timeout=30)
    assert resp.status_code == 404 and "error" in resp.json()
    bad_chat = {"model": MODEL, "messages": []}
    resp = requests.post(served.v1 + "/chat/completions", json=bad_chat, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    bad_role = {"model": MODEL, "messages": [{"role": "robot", "content": "w1"}]}
    resp = requests.post(served.v1 + "/chat/completions", json=bad_role, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.role"


def test_the_openai_client_raises_bad_request_for_bad_settings(served):
    with pytest.raises(openai.BadRequestError, match="particles"):
        served.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w1"}],
            extra_body={"particles": -3},
        )


def test_metrics_count_requests_tokens_and_method_diagnostics(served):
    client = served.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"method": "sd"})
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"method": "smc"}
    )
    served.wait_idle()
    text = requests.get(served.url + "/metrics", timeout=30).text
    values = parse_metrics(text)
    tiny = f'model_name="{MODEL}"'
    m = "{" + tiny + "}"
    assert (
        values[f'smcspec:http_requests_total{{endpoint="/v1/completions",{tiny},status="200"}}']
        >= 2
    )
    assert values[f'smcspec:generation_tokens_total{{method="sd",{tiny}}}'] >= 1
    finished = [v for k, v in values.items() if k.startswith("smcspec:request_success_total")]
    assert sum(finished) >= 2  # by finished_reason
    drafted = values[f"smcspec:spec_decode_num_draft_tokens_total{m}"]
    assert values[f"smcspec:spec_decode_num_drafts_total{m}"] >= 1
    assert drafted >= values[f"smcspec:spec_decode_num_accepted_tokens_total{m}"] > 0
    assert values[f"smcspec:smc_rounds_total{m}"] >= 1
    assert f"smcspec:smc_resamples_total{m}" in values
    assert values[f"smcspec:smc_ess_fraction_count{m}"] == values[f"smcspec:smc_rounds_total{m}"]
    assert values[f'smcspec:kv_pages_in_use{{{tiny},role="target"}}'] == 0
    assert values[f'smcspec:kv_pages_free{{{tiny},role="target"}}'] > 0
    assert values[f"smcspec:num_requests_waiting{m}"] == 0
    assert values[f'smcspec:forward_passes_total{{{tiny},role="target"}}'] >= 1
    assert values[f"smcspec:e2e_request_latency_seconds_count{m}"] >= 2


def sse_lines(served, path: str, body: dict) -> list[str]:
    resp = requests.post(served.v1 + path, json=body, stream=True, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    return [line[len("data: ") :] for line in resp.iter_lines(decode_unicode=True) if line]
