"""The method table is the one place a method is written: a row added there (and nothing else)
is a method every front end offers, and a request's settings are checked once, where they
become typed configs."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from smcspec import LLM, cli
from smcspec.cli import generate as cli_generate
from smcspec.config import SDConfig, SMCConfig
from smcspec.decoding import SpeculativeDecoder, methods
from smcspec.decoding.round_tokens import sd_tokens_per_round
from smcspec.server.app import ServeDefaults, create_app


@dataclass(frozen=True)
class FakeConfig:
    """A made-up method's settings: one, named as an existing flag and body field spell it."""

    draft_tokens: int = 1


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(str(tiny_llama_folder), str(tiny_llama_draft_folder), dtype="float32")


@pytest.fixture
def fake_method(monkeypatch):
    """A row "fake" (sd under another name, K from its own config) in the table; the configs its
    decoder was built from, in call order."""
    built: list[FakeConfig] = []

    def decoder(target, draft, config, potential, tuner):
        built.append(config)
        return SpeculativeDecoder(target, draft, SDConfig(config.draft_tokens))

    row = methods.Method(
        "fake",
        FakeConfig,
        decoder,
        kv_rows=lambda config: (1, 1),
        lookahead=lambda config: config.draft_tokens,
        tokens_per_round=lambda config, a: sd_tokens_per_round(a, config.draft_tokens),
        potentials=False,
        summary="a test's method",
        exact=True,
    )
    monkeypatch.setitem(methods.TABLE, "fake", row)
    return built


def test_a_method_added_as_one_row_reaches_python_the_cli_and_http(
    fake_method, tiny_llm, monkeypatch, capsys
):
    settings = {"draft_tokens": 3, "max_new_tokens": 4, "seed": 0}
    out = tiny_llm.generate("w1 w2", "fake", **settings)
    assert out.method == "fake" and fake_method == [FakeConfig(3)]

    monkeypatch.setattr(cli_generate, "llm_from_args", lambda args, **kwargs: tiny_llm)
    argv = ["generate", "w1 w2", "--method", "fake", "-k", "3", "--max-new-tokens", "4"]
    assert cli.main([*argv, "--seed", "0", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["method"] == "fake" and printed["token_ids"] == out.token_ids
    assert fake_method[1:] == [FakeConfig(3)]

    body = {"model": "tiny", "prompt": "w1 w2", "method": "fake", "draft_tokens": 3}
    with TestClient(create_app(tiny_llm, ServeDefaults("tiny"))) as client:
        reply = client.post("/v1/completions", json=body | {"max_tokens": 4, "seed": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["smcspec"]["method"] == "fake"
        assert fake_method[2:] == [FakeConfig(3)]
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        assert "fake" in schema["CompletionRequest"]["properties"]["method"]["enum"]
        refused = client.post("/v1/completions", json=body | {"method": "beam"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "method"
    assert "ar, sd, smc, msd, auto, fake" in refused.json()["error"]["message"]


def test_a_method_without_potentials_refuses_one_from_every_front_end(fake_method, tiny_llm):
    from smcspec.potentials import Power

    with pytest.raises(ValueError, match=r"fake .*cannot take potentials"):
        tiny_llm.generate([1, 2], "fake", power_alpha=2.0)
    assert cli.main(["generate", "w1", "--method", "fake", "--power-alpha", "2"]) == 2
    with pytest.raises(ValueError, match="cannot take potentials"):
        tiny_llm.plan([1, 2], FakeConfig(), potential=Power(2.0))


def test_http_settings_are_checked_once_per_request(tiny_llm, monkeypatch):
    """Two prompts x n = 3 choices: one SMCConfig made (and checked), shared by the six
    requests; per choice only the seed and the length change."""
    made = []
    real = SMCConfig.__post_init__

    def counted(self):
        made.append(self.particles)
        real(self)

    monkeypatch.setattr(SMCConfig, "__post_init__", counted)
    body = {"model": "tiny", "prompt": ["w1 w2", "w3"], "method": "smc", "particles": 3, "n": 3}
    with TestClient(create_app(tiny_llm, ServeDefaults("tiny"))) as client:
        made.clear()  # the server's own defaults were checked once at start
        reply = client.post("/v1/completions", json=body | {"max_tokens": 2, "seed": 1})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"]) == 6
        assert made == [3]
        made.clear()
        bad = client.post("/v1/completions", json=body | {"particles": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "particles"
    assert made == [0]


def test_auto_weighs_what_the_rows_grid_and_exact_columns_give():
    """candidates: the rows' grids, exact rows first (a tie goes to the simpler), the
    approximate ones only where not exact, and only the conditional ones with a potential.
    Fails on: smc weighed by an exact auto, ar weighed with a potential (it applies phi token
    by token, another law), msd's N read from smc's list."""
    from smcspec.config import ARConfig, MSDConfig

    grid = methods.Grid(draft_tokens=(1, 2), msd_particles=(4,), smc_particles=(2,))
    sd = [("sd", SDConfig(draft_tokens=k)) for k in (1, 2)]
    msd = [("msd", MSDConfig(particles=4, draft_tokens=k)) for k in (1, 2)]
    smc = [("smc", SMCConfig(particles=2, draft_tokens=k)) for k in (1, 2)]
    assert methods.candidates(grid) == [("ar", ARConfig()), *sd, *msd]
    assert methods.candidates(grid, exact=False) == [("ar", ARConfig()), *sd, *msd, *smc]
    assert methods.candidates(grid, has_potential=True) == smc
    given_n = methods.Grid((2,), msd_particles=(4,), smc_particles=(4,), ar=False, sd=False)
    assert methods.candidates(given_n) == [("msd", MSDConfig(particles=4, draft_tokens=2))]
