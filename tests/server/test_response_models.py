"""Every route's body against the `openai` client's own types and against the JSON the server
sent before its responses became typed models (`server.responses`): recorded from main at
10b4eb8 with the tiny llama pair, each request alone (so that no batching changes a float's last
bits), with ids, times and the diagnostics' timings masked. Floats compare to 1e-5 relative
(their last bits follow the CPU's kernels, not the server); every key, null, int, text and list
length must be the same. The diagnostics' draft_agreement and agreement_positions were added
after (issue 28: the draft's agreement with the target), recorded the same way."""

import json
import math
from pathlib import Path
from typing import Any

import pytest
import requests
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from smcspec.server import shaping
from smcspec.server.api_error import error_body
from smcspec.server.responses import ErrorResponse
from smcspec.server.schema import ChatRequest
from tests.server.conftest import MODEL

W = "w1 w2 w3"
CHAT = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
SMC_CHAT = {"method": "smc", "particles": 2, "return_particles": True}
REQUESTS = {
    "completion": ("/completions", {"prompt": W, "max_tokens": 4, "seed": 3, "method": "ar"}),
    "echo": (
        "/completions",
        {"prompt": W, "max_tokens": 2, "seed": 3, "method": "sd", "logprobs": 1, "echo": True},
    ),
    "particles": (
        "/completions",
        {
            "prompt": W,
            "max_tokens": 2,
            "seed": 1,
            "method": "smc",
            "particles": 2,
            "return_particles": True,
            "prompt_logprobs": 0,
            "logprobs": 1,
        },
    ),
    "chat": (
        "/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "seed": 5, "logprobs": True, "top_logprobs": 1}
        | SMC_CHAT,
    ),
    "chat_stream": (
        "/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 3,
            "seed": 7,
            "method": "sd",
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
        },
    ),
    "completion_stream": (
        "/completions",
        {"prompt": W, "max_tokens": 2, "seed": 4, "method": "ar", "stream": True, "echo": True},
    ),
}
TIMINGS = {"tokens_per_second", "seconds", "time_split"}
EXPECTED = {
    "completion": {
        "id": "<id>",
        "created": "<created>",
        "model": "tiny",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": None,
                "text": "w15 w46 w8",
                "smcspec": {
                    "method": "ar",
                    "diagnostics": {
                        "tokens_per_second": "<timing>",
                        "new_tokens": 4,
                        "prompt_tokens": 3,
                        "seconds": "<timing>",
                        "time_split": "<timing>",
                        "rounds": 4,
                        "seed": 3,
                        "stopped": False,
                    },
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "system_fingerprint": None,
    },
    "echo": {
        "id": "<id>",
        "created": "<created>",
        "model": "tiny",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["w1", " w2", " w3", "", " w46"],
                    "token_logprobs": [
                        None,
                        -4.219662666320801,
                        -4.192901134490967,
                        -4.1222453117370605,
                        -4.218992710113525,
                    ],
                    "top_logprobs": [
                        None,
                        {" w15": -3.9524905681610107},
                        {" w7": -3.920400857925415},
                        {" w37": -3.897869348526001},
                        {" w44": -3.7809829711914062},
                    ],
                    "text_offset": [0, 2, 5, 8, 8],
                },
                "text": "w1 w2 w3w46",
                "smcspec": {
                    "method": "sd",
                    "diagnostics": {
                        "tokens_per_second": "<timing>",
                        "new_tokens": 2,
                        "prompt_tokens": 3,
                        "seconds": "<timing>",
                        "time_split": "<timing>",
                        "rounds": 1,
                        "seed": 3,
                        "stopped": False,
                        "proposed_tokens": 1,
                        "accepted_tokens": 1,
                        "acceptance_rate": 1.0,
                        "mean_accepted_length": 1.0,
                        "tokens_per_round": 2.0,
                        "draft_agreement": 0.9397041946649551,
                        "agreement_positions": 1,
                    },
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "system_fingerprint": None,
    },
    "particles": {
        "id": "<id>",
        "created": "<created>",
        "model": "tiny",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["w11", " w8"],
                    "token_logprobs": [-4.1594038009643555, -4.2260236740112305],
                    "top_logprobs": [{"w37": -3.897869348526001}, {" w58": -3.949842691421509}],
                    "text_offset": [0, 3],
                },
                "text": "w11 w8",
                "prompt_logprobs": {
                    "tokens": ["w1", " w2", " w3"],
                    "token_logprobs": [None, -4.219662666320801, -4.192901134490967],
                    "top_logprobs": [None, {}, {}],
                    "text_offset": [0, 2, 5],
                },
                "smcspec": {
                    "method": "smc",
                    "diagnostics": {
                        "tokens_per_second": "<timing>",
                        "new_tokens": 2,
                        "prompt_tokens": 3,
                        "seconds": "<timing>",
                        "time_split": "<timing>",
                        "rounds": 1,
                        "seed": 1,
                        "stopped": False,
                        "ess": [1.9927556308348877],
                        "resamples": 0,
                        "collapses": 0,
                        "weights": [0.4698530577821942, 0.5301469422178058],
                        "log_z_hat": 0.12741131262821037,
                        "chosen_particle": 1,
                        "draft_agreement": 0.9397042822092772,
                        "agreement_positions": 2,
                    },
                    "particles": [
                        {"text": "w0 w12", "weight": 0.4698530577821942},
                        {"text": "w11 w8", "weight": 0.5301469422178058},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "system_fingerprint": None,
    },
    "chat": {
        "id": "<id>",
        "created": "<created>",
        "model": "tiny",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "logprobs": {
                    "content": [
                        {
                            "token": "w37",
                            "logprob": -4.344649314880371,
                            "bytes": [119, 51, 55],
                            "top_logprobs": [
                                {"token": "w7", "logprob": -3.8762969970703125, "bytes": [119, 55]}
                            ],
                        },
                        {
                            "token": " w19",
                            "logprob": -4.12740421295166,
                            "bytes": [32, 119, 49, 57],
                            "top_logprobs": [
                                {
                                    "token": " w38",
                                    "logprob": -3.9786195755004883,
                                    "bytes": [32, 119, 51, 56],
                                }
                            ],
                        },
                    ]
                },
                "message": {"role": "assistant", "content": "w37 w19"},
                "smcspec": {
                    "method": "smc",
                    "diagnostics": {
                        "tokens_per_second": "<timing>",
                        "new_tokens": 2,
                        "prompt_tokens": 3,
                        "seconds": "<timing>",
                        "time_split": "<timing>",
                        "rounds": 1,
                        "seed": 5,
                        "stopped": False,
                        "ess": [1.979961429494622],
                        "resamples": 0,
                        "collapses": 0,
                        "weights": [0.44969918662248415, 0.5503008133775159],
                        "log_z_hat": -0.06969147832234401,
                        "chosen_particle": 0,
                        "draft_agreement": 0.9367434801533818,
                        "agreement_positions": 2,
                    },
                    "particles": [
                        {"text": "w37 w19", "weight": 0.44969918662248415},
                        {"text": "w13 w16", "weight": 0.5503008133775159},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "system_fingerprint": None,
    },
    "chat_stream": [
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "chat.completion.chunk",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "w14 w14 w56"},
                    "finish_reason": None,
                    "logprobs": None,
                }
            ],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "finish_reason": "length",
                    "logprobs": {
                        "content": [
                            {
                                "token": "w14",
                                "logprob": -3.9626657962799072,
                                "bytes": [119, 49, 52],
                                "top_logprobs": [],
                            },
                            {
                                "token": " w14",
                                "logprob": -4.198441028594971,
                                "bytes": [32, 119, 49, 52],
                                "top_logprobs": [],
                            },
                            {
                                "token": " w56",
                                "logprob": -4.119574069976807,
                                "bytes": [32, 119, 53, 54],
                                "top_logprobs": [],
                            },
                        ]
                    },
                    "smcspec": {
                        "method": "sd",
                        "diagnostics": {
                            "tokens_per_second": "<timing>",
                            "new_tokens": 3,
                            "prompt_tokens": 3,
                            "seconds": "<timing>",
                            "time_split": "<timing>",
                            "rounds": 1,
                            "seed": 7,
                            "stopped": False,
                            "proposed_tokens": 2,
                            "accepted_tokens": 2,
                            "acceptance_rate": 1.0,
                            "mean_accepted_length": 2.0,
                            "tokens_per_round": 3.0,
                            "draft_agreement": 0.9362108502537012,
                            "agreement_positions": 2,
                        },
                    },
                }
            ],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        },
        "[DONE]",
    ],
    "completion_stream": [
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "w1 w2 w3", "finish_reason": None, "logprobs": None}],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "w27", "finish_reason": None, "logprobs": None}],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "text_completion",
            "choices": [{"index": 0, "text": " w43", "finish_reason": None, "logprobs": None}],
        },
        {
            "id": "<id>",
            "created": "<created>",
            "model": "tiny",
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "finish_reason": "length",
                    "logprobs": None,
                    "smcspec": {
                        "method": "ar",
                        "diagnostics": {
                            "tokens_per_second": "<timing>",
                            "new_tokens": 2,
                            "prompt_tokens": 3,
                            "seconds": "<timing>",
                            "time_split": "<timing>",
                            "rounds": 2,
                            "seed": 4,
                            "stopped": False,
                        },
                    },
                }
            ],
        },
        "[DONE]",
    ],
}

ROUTES = {
    "models": {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": "<created>", "owned_by": "smcspec"}],
    },
    "tokenize": {"count": 3, "max_model_len": 128, "tokens": [4, 5, 6]},
    "tokenize_chat": {"count": 3, "max_model_len": 128, "tokens": [8, 4, 5]},
    "detokenize": {"prompt": "w1 w2 w3"},
}

ERRORS = [
    [
        400,
        {
            "error": {
                "message": "unknown model 'nope': this server serves 'tiny'",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        },
    ],
    [
        400,
        {
            "error": {
                "message": "unknown field 'bogus'",
                "type": "invalid_request_error",
                "param": "bogus",
                "code": None,
            }
        },
    ],
    [
        404,
        {
            "error": {
                "message": "Not Found",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        },
    ],
]

HEALTH = {
    "status": "ok",
    "model": "tiny",
    "target": "<the target's folder>",
    "draft": "<the draft's folder>",
    "backend": "native",
    "dtype": "float32",
    "scheduler_alive": True,
    "running": 0,
    "queued": 0,
    # the defaults of config.EngineLimits and HTTPLimits, the pool as the native engine builds it
    "limits": {
        "max_running": 64,
        "max_batch_tokens": 256,
        "kv_pages": 4096,
        "page_size": 16,
        "max_body_bytes": 4 * 2**20,
        "shutdown_timeout": 5.0,
        "read_timeout": 10.0,
        "write_timeout": 60.0,
    },
}


def masked(value: Any) -> Any:
    """The body with what changes from run to run replaced: a response's id and time, a tool
    call's id, and the diagnostics' timings."""
    if isinstance(value, list):
        return [masked(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        generated = key == "id" and v.startswith(("cmpl-", "chatcmpl-", "call_"))
        if key == "created" or generated:
            out[key] = f"<{key}>"
        else:
            out[key] = "<timing>" if key in TIMINGS else masked(v)
    return out


def assert_same(actual: Any, expected: Any, where: str = "body") -> None:
    """The same JSON: keys, types (an int is not a float), nulls and values; floats to 1e-5."""
    assert type(actual) is type(expected), f"{where}: {actual!r} where {expected!r} was sent"
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{where}: keys {list(actual)}"
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items, not {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=1e-5), f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def post(served, name: str) -> requests.Response:
    path, body = REQUESTS[name]
    response = requests.post(served.v1 + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def events(response: requests.Response) -> list[Any]:
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in data]


@pytest.mark.parametrize("name", ["completion", "echo", "particles", "chat"])
def test_a_response_is_the_json_sent_before_and_an_openai_object(served, name):
    body = post(served, name).json()
    assert_same(masked(body), EXPECTED[name])
    if name != "echo":  # the SDK types token_logprobs as floats; OpenAI too sends an echo's null
        (ChatCompletion if name == "chat" else Completion).model_validate(body)


@pytest.mark.parametrize("name", ["chat_stream", "completion_stream"])
def test_a_stream_is_the_events_sent_before_and_openai_chunks(served, name):
    sent = events(post(served, name))
    assert_same(masked(sent), EXPECTED[name])
    assert sent[-1] == "[DONE]"
    for chunk in sent[:-1]:
        if name == "chat_stream":
            ChatCompletionChunk.model_validate(chunk)
        elif all(choice["finish_reason"] for choice in chunk["choices"]):
            # the SDK types a streamed completion chunk as a Completion, whose finish_reason
            # is never null (OpenAI sends null until the last chunk, as the server does)
            Completion.model_validate(chunk)


def test_the_openai_client_reads_the_same_json(served):
    client = served.client()
    out = client.completions.create(
        model=MODEL, prompt=W, max_tokens=4, seed=3, extra_body={"method": "ar"}
    )
    assert_same(masked(out.to_dict()), EXPECTED["completion"])
    asked = {"messages": CHAT, "max_tokens": 2, "seed": 5, "logprobs": True, "top_logprobs": 1}
    chat = client.chat.completions.create(model=MODEL, **asked, extra_body=SMC_CHAT)
    assert_same(masked(chat.to_dict()), EXPECTED["chat"])
    _, body = REQUESTS["chat_stream"]
    settings = {k: v for k, v in body.items() if k != "method"}
    stream = client.chat.completions.create(model=MODEL, **settings, extra_body={"method": "sd"})
    assert_same([masked(c.to_dict()) for c in stream], EXPECTED["chat_stream"][:-1])


def test_models_tokenizer_routes_health_and_errors_are_the_json_sent_before(served):
    models = requests.get(served.v1 + "/models", timeout=10).json()
    assert_same(masked(models), ROUTES["models"])
    assert [Model.model_validate(card).id for card in models["data"]] == [MODEL]
    asked = {
        "tokenize": {"model": MODEL, "prompt": W},
        "tokenize_chat": {"messages": CHAT},
        "detokenize": {"tokens": [4, 5, 6]},
    }
    for name, body in asked.items():
        path = "/detokenize" if name == "detokenize" else "/tokenize"
        assert_same(requests.post(served.url + path, json=body, timeout=10).json(), ROUTES[name])
    names = [Path(name).name for name in served.llm.names]
    health = requests.get(served.url + "/health", timeout=10).json()
    assert_same(health, HEALTH | {"target": names[0], "draft": names[1]})
    refused = [
        requests.post(served.v1 + "/completions", json={"model": "nope", "prompt": W}),
        requests.post(served.v1 + "/completions", json={"model": MODEL, "prompt": W, "bogus": 1}),
        requests.get(served.url + "/nowhere"),
    ]
    assert_same([[r.status_code, r.json()] for r in refused], ERRORS)
    for r in refused:
        ErrorObject.model_validate(r.json()["error"])


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALLED = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_calls_are_openai_messages_and_deltas():
    """As main sent them (tests/server/test_tools.py runs them through a server)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = ChatRequest(model=MODEL, messages=[{"role": "user", "content": "w1"}], tools=[tool])
    message, reason = shaping.assistant_message(body, CALL, "stop")
    call = {"id": "<id>", "type": "function", "function": CALLED}
    expected = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert (reason, masked(message.model_dump())) == ("tool_calls", expected)
    ChatCompletionMessage.model_validate(message.model_dump())
    delta, reason = shaping.tool_calls_delta(body, CALL, "stop")
    expected = {"content": None, "tool_calls": [{"index": 0, **call}]}
    assert (reason, masked(delta.model_dump())) == ("tool_calls", expected)
    ChoiceDelta.model_validate(delta.model_dump())
    plain, reason = shaping.assistant_message(body, "w1 w2", "length")
    assert (reason, plain.model_dump()) == ("length", {"role": "assistant", "content": "w1 w2"})


@pytest.mark.parametrize(
    "args", [("bad",), ("bad", "n", "too_many", "server_error"), ("shh", None, "invalid_api_key")]
)
def test_the_guards_error_body_is_the_error_model(args):
    """The guard and the connection layer still write `api_error.error_body`'s dict."""
    assert error_body(*args) == ErrorResponse.of(*args).model_dump()


def test_openapi_gives_each_route_its_response_model(served):
    schema = requests.get(served.url + "/openapi.json", timeout=10).json()
    models = {
        ("/v1/completions", "post"): "Completion",
        ("/v1/chat/completions", "post"): "ChatCompletion",
        ("/v1/models", "get"): "ModelList",
        ("/health", "get"): "Health",
        ("/tokenize", "post"): "Tokenized",
        ("/detokenize", "post"): "Detokenized",
    }
    for (path, method), name in models.items():
        answers = schema["paths"][path][method]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith(name)
    choice = schema["components"]["schemas"]["CompletionChoice"]
    assert {"index", "finish_reason", "logprobs", "text", "smcspec"} <= set(choice["required"])
    error = answers["400"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("ErrorResponse")
