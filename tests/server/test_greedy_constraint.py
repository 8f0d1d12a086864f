"""Greedy decoding under a constraint over HTTP: `temperature: 0` with a `response_format` JSON
schema, or with tools under tool_choice "required", is a 200 whose text parses and follows the
schema, the same from ar and smc (the likeliest allowed token at every step). Before, whenever
the model's top token was not allowed, it was a 400 ("the sampling settings ... leave none of
the tokens the constraint allows").

On a tiny random model with one token per byte and tool-call tokens (tests/server/test_tools.py)."""

import json

import pytest
import requests

from smcspec.server.app import ServeDefaults
from tests.server.test_tools import WEATHER, serve_byte_pair

MODEL = "tiny-bytes"
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_byte_pair(tmp_path_factory, ServeDefaults(MODEL, particles=3, max_tokens=128))


def chat(served, **extra) -> requests.Response:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "seed": 0, **extra}
    return requests.post(served.v1 + "/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def replies(served) -> dict[str, requests.Response]:
    """Each method's greedy reply under the schema, and ar's without it. The frequency
    penalty keeps this random model from spending its tokens on the whitespace that JSON
    allows between tokens (greedy, it repeats one blank to the length limit)."""
    shape = {"response_format": RESPONSE_FORMAT, "frequency_penalty": 1.0}
    out = {m: chat(served, method=m, **shape) for m in ("ar", "smc")}
    return out | {"free": chat(served, method="ar", max_tokens=4)}


def follows_schema(reply: object) -> bool:
    return (
        isinstance(reply, dict)
        and set(reply) == {"answer", "score"}
        and reply["answer"] in ("yes", "no")
        and type(reply["score"]) is int
        and 0 <= reply["score"] <= 9
    )


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_greedy_json_schema_is_a_200_that_follows_the_schema(replies, method):
    r = replies[method]
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert follows_schema(json.loads(choice["message"]["content"])), choice


def test_greedy_json_is_one_text_from_ar_and_smc_where_the_top_token_was_not_allowed(replies):
    """One greedy text; the model's own greedy reply does not start as the JSON does, so the
    constraint, not the model, chose at least the first token."""
    texts = {m: replies[m].json()["choices"][0]["message"]["content"] for m in replies}
    assert texts["ar"] == texts["smc"]
    assert not texts["free"].startswith(texts["ar"][:1]), texts


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_greedy_tool_call_is_a_200_with_arguments_that_follow_the_schema(served, method):
    r = chat(served, method=method, tools=[WEATHER], tool_choice="required")
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) <= {"city", "days"} and arguments["city"] in ("Paris", "Rome")
    days = arguments.get("days", 1)
    assert type(days) is int and 1 <= days <= 14, arguments
