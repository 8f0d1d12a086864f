"""Token log-probabilities in OpenAI's shapes: `logprobs` (completions) and `logprobs` +
`top_logprobs` (chat), streamed or not, the same numbers `LLM.generate(..., logprobs=k)` gives."""

import math

import pytest
import requests

from smcspec.decoding.methods import method_row
from tests.server.conftest import MODEL

PROMPT = "w1 w2 w3"
METHODS = [
    {"method": "ar"},
    {"method": "sd", "draft_tokens": 2},
    {"method": "smc", "particles": 3, "draft_tokens": 2},
]


def offline(served, prompt, chat: bool, seed: int, top: int, max_tokens: int = 8, **extra):
    """`LLM.generate` with the server's defaults filled in (and the prompt scored)."""
    reads = method_row(extra.get("method", "auto")).settings  # as the server fills them
    defaults = {k: v for k, v in {"particles": 4, "draft_tokens": 3}.items() if k in reads}
    settings = defaults | {"temperature": 1.0, **extra}
    return served.llm.generate(
        prompt,
        chat=chat,
        seed=seed,
        max_new_tokens=max_tokens,
        logprobs=top,
        prompt_logprobs=top,
        **settings,
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


def test_echo_puts_the_prompt_and_its_logprobs_first(served):
    client = served.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=2)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=2, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None  # none asked for
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, seed=2, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    want = offline(served, PROMPT, False, 2, 1, max_tokens=6)
    prompt_ids = served.llm.encode(PROMPT, chat=False)
    assert scored.choices[0].text == PROMPT + want.text
    # (each token's text is what it adds after the tokens before it: this word-level test
    # tokenizer adds the space between words that the completion's own text starts without)
    n = len(prompt_ids)
    assert len(lp.tokens) == n + len(want.token_ids)
    assert "".join(lp.tokens).replace(" ", "") == scored.choices[0].text.replace(" ", "")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(want.prompt_logprobs.chosen[1:], abs=1e-6)
    assert lp.token_logprobs[n:] == pytest.approx(want.logprobs.chosen, abs=1e-6)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, seed=2, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_prompt_logprobs_as_vllm_names_them(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "seed": 1, "prompt_logprobs": 0}
    choice = requests.post(served.v1 + "/completions", json=body, timeout=30).json()["choices"][0]
    scores = choice["prompt_logprobs"]
    assert scores["token_logprobs"][0] is None
    assert len(scores["tokens"]) == len(served.llm.encode(PROMPT, chat=False))
    assert all(v <= 0 for v in scores["token_logprobs"][1:])
