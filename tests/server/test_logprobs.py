"""Token log-probabilities in OpenAI's shapes: `logprobs` (completions) and `logprobs` +
`top_logprobs` (chat), streamed or not, the same numbers `LLM.generate(..., logprobs=k)` gives."""

import math

import pytest
import requests

from tests.server.conftest import MODEL

PROMPT = "w1 w2 w3"
METHODS = [
    {"method": "ar"},
    {"method": "sd", "draft_tokens": 2},
    {"method": "smc", "particles": 3, "draft_tokens": 2},
]


def offline(served, prompt, chat: bool, seed: int, top: int, **extra):
    """`LLM.generate` with the server's defaults filled in."""
    settings = {"particles": 4, "draft_tokens": 3, "temperature": 1.0, **extra}
    return served.llm.generate(
        prompt, chat=chat, seed=seed, max_new_tokens=8, logprobs=top, **settings
    )


@pytest.mark.parametrize("extra", METHODS, ids=lambda s: s["method"])
def test_completion_logprobs_are_generates(served, extra):
    out = served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, seed=7, logprobs=2, extra_body=extra
    )
    want = offline(served, PROMPT, False, 7, 2, **extra)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens == len(want.token_ids) > 0
    assert lp.token_logprobs == pytest.approx(want.logprobs.chosen, abs=1e-6)
    assert "".join(lp.tokens) == out.choices[0].text == want.text  # no stop string here
    pieces = zip(lp.top_logprobs, want.logprobs.top, lp.token_logprobs, strict=True)
    for top, pairs, chosen in pieces:
        assert len(top) == 2 and max(top.values()) >= chosen - 1e-6
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in pairs])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_not_are_the_same(served):
    messages = [{"role": "user", "content": PROMPT}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 3, "logprobs": True}
    client = served.client()
    whole = client.chat.completions.create(**ask, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 0
    for entry in content:
        assert len(entry.top_logprobs) == 3 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    streamed = []
    for chunk in client.chat.completions.create(**ask, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    bare = client.chat.completions.create(**ask).choices[0].logprobs.content
    assert [e.logprob for e in bare] == [e.logprob for e in content]
    assert all(e.top_logprobs == [] for e in bare)


def test_no_logprobs_unless_asked(served):
    out = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=1)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/chat/completions", {"top_logprobs": 2}, None),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ],
)
def test_bad_logprobs_settings_get_a_400(served, route, body, param):
    if route == "/chat/completions":
        body = {"messages": [{"role": "user", "content": PROMPT}], **body}
    resp = requests.post(served.v1 + route, json={"model": MODEL, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
