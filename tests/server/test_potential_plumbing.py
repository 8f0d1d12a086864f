"""The potential settings of a request body (power_alpha, response_format) reach the decoder with
the values sent, and move the law: read from what `make_decoder` receives and from the response,
against the model's own logits (transformers) and llguidance's own compilation of the schema,
not against `LLM.generate`, which shares the server's code.

max_tokens=1 makes a decode one exact step: log Z-hat is log sum_v p(v | prompt)^alpha (see
tests/engine/test_potential_plumbing.py)."""

import json

import llguidance
import pytest
import requests
import torch

from smcspec.potentials import Constraint, Power
from smcspec.server.app import ServeDefaults
from tests.plumbing import byte_pair, factor, next_token_log_probs, record_decoders
from tests.server.conftest import serve

MODEL = "tiny-bytes"
PROMPT = "ab"
# Float32 log-probabilities (two implementations of the model) summed in float64.
EXACT = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = byte_pair(tmp_path_factory)
    handle, server, thread = serve(llm, ServeDefaults(MODEL, particles=6, max_tokens=12))
    yield handle
    server.should_exit = True
    thread.join(timeout=30)


def complete(served, **body) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "seed": 0, **body}
    resp = requests.post(served.v1 + "/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.parametrize("method", ["smc", "ar"])
def test_power_alpha_reaches_the_decoder_as_sent(served, monkeypatch, method):
    seen = record_decoders(monkeypatch)
    complete(served, method=method, power_alpha=4.0, max_tokens=2)
    assert factor(seen[-1][1], Power).alpha == 4.0


def test_power_alpha_sets_the_normalizer_it_samples(served):
    folder = served.llm.names[0]
    logp = next_token_log_probs(folder, served.llm.tokenizer.encode(PROMPT))
    want = float(torch.logsumexp(4.0 * logp, 0))
    assert abs(want) > 0.1  # alpha = 1 would give 0: the check tells alpha apart from 1
    body = {"method": "smc", "power_alpha": 4.0, "max_tokens": 1, "temperature": 1.0}
    got = complete(served, **body)["smcspec"]["diagnostics"]["log_z_hat"]
    assert got == pytest.approx(want, abs=EXACT)


SCHEMA = {"enum": ["ab", "cd"]}


@pytest.mark.parametrize(
    ("response_format", "schema"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, SCHEMA),
        ({"type": "json_object"}, {"type": "object"}),
    ],
    ids=["json_schema", "json_object"],
)
def test_response_format_reaches_the_decoder_as_sent(served, monkeypatch, response_format, schema):
    seen = record_decoders(monkeypatch)
    choice = complete(served, method="smc", response_format=response_format, max_tokens=12)
    want = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert factor(seen[-1][1], Constraint).grammar == want
    if schema is SCHEMA:  # short enough that a valid particle is certain within 12 tokens
        assert choice["smcspec"]["diagnostics"]["valid_particles"] >= 1
        assert json.loads(choice["text"]) in SCHEMA["enum"]
