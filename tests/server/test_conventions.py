"""Conventions clients of inference servers rely on: OpenAI fields with a neutral value are
accepted (and change nothing), and vLLM's /tokenize and /detokenize."""

import pytest
import requests

from smcspec import LLM
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.server.api_error import ApiError
from smcspec.server.runtime import ServeDefaults, Server
from smcspec.server.schema import DetokenizeRequest, TokenizeCompletionRequest
from tests.server.conftest import MODEL

MESSAGES = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 3, "method": "ar"}
FUNCTION_NAME = "tools.0.function.name"
NEUTRAL = {
    "tools": [],
    "parallel_tool_calls": True,
    "metadata": {"session": "abc"},
    "store": False,
    "service_tier": "auto",
    "user": "someone",
}


def post(served, path: str, body: dict) -> requests.Response:
    return requests.post(served.url + path, json=body, timeout=60)


def test_neutral_openai_fields_are_accepted_and_change_nothing(served):
    plain = post(served, "/v1/chat/completions", CHAT)
    assert plain.status_code == 200, plain.text
    named = [{**m, "name": "ann"} for m in MESSAGES]
    out = post(served, "/v1/chat/completions", {**CHAT, **NEUTRAL, "messages": named})
    assert out.status_code == 200, out.text
    text = out.json()["choices"][0]["message"]["content"]
    assert text == plain.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f g"}}]},
            "tools.0.function.name",
            "match",
        ),
        ({"tool_choice": "required"}, None, "no tools are given"),
        ({"store": True}, "store", "store must be false"),
        ({"metadata": {"k": 1}}, "metadata.k", "string"),
        ({"frobnicate": 1}, "frobnicate", "unknown field"),
        ({"tool_calls_please": []}, "tool_calls_please", "unknown field"),
    ],
)
def test_fields_that_ask_for_something_missing_are_refused_by_name(served, extra, param, says):
    r = post(served, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "Value error" not in error["message"]


def test_chat_only_fields_are_unknown_to_completions(served):
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 2, "tools": []}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_tokenize_then_detokenize_round_trips_a_text(served):
    text = "w1 w2 w3 w40"
    out = post(served, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert out["tokens"] == served.llm.encode(text, chat=False)
    assert out["count"] == len(out["tokens"]) == 4
    assert out["max_model_len"] == served.llm.target.context_length == 128
    back = post(served, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_a_chat_completion_reads(served):
    out = post(served, "/tokenize", {"messages": MESSAGES}).json()  # model may be left out
    assert out["tokens"] == served.llm.encode_messages(MESSAGES)
    usage = post(served, "/v1/chat/completions", CHAT).json()["usage"]
    assert out["count"] == usage["prompt_tokens"] == 3
    bare = {"messages": MESSAGES, "add_generation_prompt": False, "add_special_tokens": True}
    assert post(served, "/tokenize", bare).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"model": MODEL, "tokens": [4, 64]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": []}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": ["4"]}, "tokens.0"),
        ("/detokenize", {"model": "other", "tokens": [4]}, "model"),
        ("/tokenize", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "w1"}, "model"),
        ("/tokenize", {"model": MODEL, "prompt": "w1", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
        (
            "/tokenize",
            {"model": MODEL, "prompt": "w1", "add_generation_prompt": True},
            "add_generation_prompt",
        ),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"model": MODEL}, "prompt"),
    ],
)
def test_bad_tokenizer_requests_get_a_400_naming_the_field(served, path, body, param):
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_a_model_without_a_tokenizer_refuses_to_tokenize():
    target = random_lm(5, seed=1)
    server = Server(LLM.from_models(target, perturbed_lm(target, 2, 0.5)), ServeDefaults("m"))
    try:
        with pytest.raises(ApiError, match="no tokenizer"):
            server.tokenize(TokenizeCompletionRequest(prompt="a b"))
        with pytest.raises(ApiError, match="no tokenizer"):
            server.detokenize(DetokenizeRequest(tokens=[1]))
    finally:
        server.shutdown()
