"""A constrained decode's per-particle states (llguidance matchers) cost memory: a grammar is
compiled once per constraint, and the states are dropped when the decode ends, returned or not
(issue 12: 470 MB -> 2.5 GB RSS after n=8 x particles=16 on a 2000-branch anyOf, kept)."""

import json

import llguidance
import pytest
import torch

from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import SMCDecoder, smc_guide
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.potentials import Constraint
from tests.test_potentials import ByteTokenizer

V = 257
PROMPT = [ord("x") + 1]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=12)
BRANCHES = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "integer"}},
            "required": [f"k{i}"],
            "additionalProperties": False,
        }
        for i in range(200)
    ]
}


@pytest.fixture(scope="module")
def constraint():
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))
    return Constraint.json_schema(json.dumps(BRANCHES), tokenizer, V)


@pytest.fixture(scope="module")
def pair():
    target = random_lm(V, seed=41, scale=2.0)
    return target, perturbed_lm(target, seed=42, noise=0.8)


@pytest.fixture
def guides(monkeypatch):
    """Every Guide the SMC decoder makes, kept alive by the test."""
    made = []

    class Recorded(smc_guide.Guide):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(smc_guide, "Guide", Recorded)
    return made


def test_a_grammar_is_compiled_once_not_once_per_particle(pair, constraint, monkeypatch):
    fresh = Constraint(constraint.grammar, constraint.tokenizer, V)
    compiled = []
    real = llguidance.LLMatcher

    def counting(*args, **kwargs):
        compiled.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    decoder = SMCDecoder(*pair, SMCConfig(16, 2, 0.5), fresh)
    for seed in range(3):
        decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(seed))
    # compiled when the constraint was built (to probe it), so a decode only copies it; it was
    # 16 per decode: one compiled grammar per particle
    assert len(compiled) == 0


def test_states_are_dropped_when_the_decode_returns(pair, constraint, guides):
    decoder = SMCDecoder(*pair, SMCConfig(16, 2, 0.5), constraint)
    out = decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(0))
    assert min(out.tokens) >= 0 and max(out.tokens) < V
    assert len(guides) == 1 and guides[0].states == []


class _Failing(Constraint):
    """The constraint, whose states raise at the 40th token (a fault mid-decode)."""

    def advance(self, state, token):
        self.advanced = getattr(self, "advanced", 0) + 1
        if self.advanced == 40:
            raise RuntimeError("the matcher broke")
        return super().advance(state, token)


def test_states_are_dropped_when_the_decode_fails(pair, constraint, guides):
    """A failed job's error is kept by its future, and with it the decode's frames: the states
    must not live as long as that error does."""
    failing = _Failing(constraint.grammar, constraint.tokenizer, V)
    decoder = SMCDecoder(*pair, SMCConfig(16, 2, 0.5), failing)
    with pytest.raises(RuntimeError, match="broke") as caught:
        decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(0))
    assert caught.value.__traceback__ is not None  # the frames are still reachable
    assert len(guides) == 1 and guides[0].states == []
