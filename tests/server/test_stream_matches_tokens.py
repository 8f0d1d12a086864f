"""Over HTTP, a choice's text (whole, or its streamed deltas joined) is the decode of the tokens
the server's job produced, cut before the first stop string, for every method, on completions
and chat, with smc particles that disagree. The tokens are read from the job's result as the
server finishes it; the oracle is the tokenizer's own decode."""

import json

import pytest
import requests

from tests.plumbing import check_text, returned_is_not_the_first
from tests.server.conftest import MODEL

SETTINGS = {
    "ar": {"method": "ar"},
    "sd": {"method": "sd", "draft_tokens": 2},
    "smc": {"method": "smc", "particles": 4, "draft_tokens": 2},
}
PROMPT = {
    "/completions": {"prompt": "w1 w2"},
    "/chat/completions": {"messages": [{"role": "user", "content": "w1 w2"}]},
}
SEEDS = range(3)


def record_results(served, monkeypatch) -> list:
    """Every `GenerationResult` the server finishes from now on, in order."""
    seen = []
    real = served.server.finish

    def spy(result, particles):
        seen.append(result)
        return real(result, particles)

    monkeypatch.setattr(served.server, "finish", spy)
    return seen


def text_of(served, path: str, body: dict) -> str:
    """The choice's text: the whole body's, or the streamed deltas joined."""
    resp = requests.post(served.v1 + path, json=body, stream=body["stream"], timeout=60)
    assert resp.status_code == 200, resp.text
    chat = path == "/chat/completions"
    if not body["stream"]:
        choice = resp.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    lines = [line[len("data: ") :] for line in resp.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"] for line in lines[:-1]]
    if chat:
        return "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    return "".join(c[0]["text"] for c in chunks if c)


@pytest.mark.parametrize("path", list(PROMPT))
@pytest.mark.parametrize("method", list(SETTINGS))
def test_text_is_the_decode_of_the_tokens_streamed_or_not(served, monkeypatch, path, method):
    def decode(ids: list[int]) -> str:
        return served.llm.tokenizer.decode(ids, skip_special_tokens=True)

    results = record_results(served, monkeypatch)
    body = {"model": MODEL, "max_tokens": 12, "temperature": 1.0, **PROMPT[path]}
    body |= SETTINGS[method]
    stopped, chosen_not_first = 0, 0
    for seed in SEEDS:
        free = text_of(served, path, {**body, "seed": seed, "stream": False})
        check_text(decode, free, results[-1].token_ids, ())
        words = free.split()
        stops = [" " + words[2], "never"] if len(words) > 2 else ["never"]
        asked = {**body, "seed": seed, "stop": stops}
        whole = text_of(served, path, {**asked, "stream": False})
        stopped += check_text(decode, whole, results[-1].token_ids, stops)
        streamed = text_of(served, path, {**asked, "stream": True})
        check_text(decode, streamed, results[-1].token_ids, stops)
        assert streamed == whole
        for out in results[-3:]:
            chosen_not_first += returned_is_not_the_first(out)
    assert stopped >= 1, "a stop string must end some decode"
    assert method != "smc" or chosen_not_first >= 2, "the returned particle must not be the first"
