"""Greedy decoding under a constraint: at temperature 0 each token is the arg-max of the adjusted
logits among the tokens the constraint allows, the first under ties (the limit T -> 0 of the
shaped law softmax(l / T)^alpha * mask / norm), for ar and for smc with any N and any proposal.
Before, the greedy law (all mass on the unconstrained arg-max) was masked afterwards and came out
empty wherever that token was not allowed: a ConstraintError. An allowed set that is really
empty, or that top-k / top-p / min-p empty at T > 0, is still one.

Toy models over the byte vocabulary of tests/test_potentials (EOS = 0, byte b = token b + 1).
The oracle reads the allowed tokens from llguidance's own matcher and the adjusted logits from
tests/oracle.py, and takes the arg-max in plain Python."""

from __future__ import annotations

import dataclasses

import llguidance
import llguidance.torch
import pytest
import torch

from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import AutoregressiveDecoder, SMCDecoder
from smcspec.models.toy import ToyLM, perturbed_lm, random_lm
from smcspec.potentials import Constraint, ConstraintError, Potential, Power, Product, TokenRule
from tests import oracle
from tests.test_constraint_limits import byte
from tests.test_potentials import byte_guidance_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 257
EOS = 0
PROMPT = [ord("q") + 1]
PATTERNS = ["[a-h]{2,6}", r'\{"n": [0-9]{1,3}\}']
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)
# "z" is the likeliest token everywhere and never allowed; "c" and "3" gain enough to win some
# steps; the penalties move repeated letters and digits down.
ADJUSTED = SamplingConfig(
    temperature=0.0,
    max_new_tokens=12,
    logit_bias={ord("z") + 1: 20.0, ord("c") + 1: 2.0, ord("3") + 1: 4.0},
    repetition_penalty=1.6,
    presence_penalty=1.0,
)
# name: (particles, draft tokens, draft temperature); None: ar
METHODS = {
    "ar": None,
    "smc N=1": (1, 3, None),
    "smc N=4": (4, 2, None),
    "smc N=4, sampled drafts": (4, 3, 1.0),
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_guidance_tokenizer()


@pytest.fixture(scope="module")
def pair():
    target = random_lm(V, seed=41, scale=2.0)
    return target, perturbed_lm(target, seed=42, noise=1.5)


def allowed_by(matcher) -> list[int]:
    """The token ids llguidance's matcher allows next, in increasing order."""
    words = llguidance.torch.allocate_token_bitmask(1, V)
    llguidance.torch.fill_next_token_bitmask(matcher, words, 0)
    row = [int(w) for w in words[0]]
    return [t for t in range(V) if row[t // 32] >> (t % 32) & 1]


def first_argmax(values: list[float], among: list[int]) -> int:
    return max(among, key=lambda t: values[t])  # max keeps the first of ties


def oracle_greedy(
    model: ToyLM, pattern: str, cfg: SamplingConfig, tokenizer
) -> tuple[list[int], int]:
    """The greedy constrained decode, one token at a time, and at how many of its steps the
    unconstrained arg-max was not allowed."""
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    out: list[int] = []
    blocked = 0
    while len(out) < cfg.max_new_tokens:
        context = PROMPT + out
        raw = model.logits(tuple(context)).double().tolist()
        logits = oracle.adjusted(raw, context, len(PROMPT), cfg)
        allowed = allowed_by(matcher)
        assert allowed, "the pattern must never leave nothing allowed"
        best = first_argmax(logits, allowed)
        blocked += first_argmax(logits, list(range(V))) not in allowed
        out.append(best)
        if best == EOS:
            break
        assert matcher.consume_token(best)
    return out, blocked


def decoder(method: str, pair, potential: Potential):
    target, draft = pair
    if METHODS[method] is None:
        return AutoregressiveDecoder(target, potential)
    n, k, _ = METHODS[method]
    return SMCDecoder(target, draft, SMCConfig(n, k, 0.5), potential)


def with_draft_temperature(cfg: SamplingConfig, method: str) -> SamplingConfig:
    settings = METHODS[method]
    if settings is None or settings[2] is None:
        return cfg
    return dataclasses.replace(cfg, draft_temperature=settings[2])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("power", [None, 3.0])
@pytest.mark.parametrize("cfg", [GREEDY, ADJUSTED], ids=["plain", "bias and penalties"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_takes_the_likeliest_allowed_token_at_every_step(
    pair, tokenizer, method, power, pattern, cfg
):
    """ar and smc return the oracle's sequence; a power alpha does not move it (the limit is
    the same arg-max). smc's surviving particles are all that sequence with equal weights, and
    a greedy proposal makes every particle that sequence."""
    expected, blocked = oracle_greedy(pair[0], pattern, cfg, tokenizer)
    assert blocked >= 3 and expected[-1] == EOS  # the mask decides, and the decode ends
    if cfg is ADJUSTED:  # and so do the bias and penalties
        assert expected != oracle_greedy(pair[0], pattern, GREEDY, tokenizer)[0]
    potential: Potential = Constraint.regex(pattern, tokenizer, V)
    if power is not None:
        potential = Product([Power(power), potential])
    out = decoder(method, pair, potential).decode(
        PROMPT, with_draft_temperature(cfg, method), torch.Generator().manual_seed(0)
    )
    assert out.tokens == expected, bytes(t - 1 for t in out.tokens if t)
    if out.particles is None:
        return
    weights = torch.tensor(out.stats.weights, dtype=torch.float64)
    assert not weights.isnan().any()
    alive = [p for p, w in zip(out.particles, weights, strict=True) if w > 0]
    assert alive and all(p == expected for p in alive), out.particles
    assert torch.allclose(weights[weights > 0], torch.tensor(1 / len(alive), dtype=torch.float64))
    if METHODS[method][2] is None:  # a greedy proposal: N copies of one sequence
        assert len(alive) == len(out.particles)


def test_smc_takes_both_paths_of_a_greedy_round(pair, tokenizer):
    """Rounds whose drafts are the target's tokens commit k + 1 tokens at zero weight change;
    rounds whose drafts stray are replaced by one exact step. Both happen here, so the
    comparison above covers both."""
    expected, _ = oracle_greedy(pair[0], PATTERNS[1], GREEDY, tokenizer)
    potential = Constraint.regex(PATTERNS[1], tokenizer, V)
    out = decoder("smc N=1", pair, potential).decode(PROMPT, GREEDY, torch.Generator())
    assert out.tokens == expected
    assert 0 < out.stats.collapses < out.rounds, (out.stats.collapses, out.rounds)


def tied_lm() -> ToyLM:
    """Logits 5 on "z", 3 on "b" and "d", 0 elsewhere, whatever the prefix."""

    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(V)
        out[byte("z")], out[byte("b")], out[byte("d")] = 5.0, 3.0, 3.0
        return out

    return ToyLM(logits, V, {EOS})


def b_to_e() -> TokenRule:
    """Any of "b", "c", "d", "e"; never "z" nor EOS."""
    mask = torch.zeros(V, dtype=torch.bool)
    mask[byte("b") : byte("e") + 1] = True
    return TokenRule(lambda prefix: mask, complete=lambda prefix: True)


@pytest.mark.parametrize("method", ["ar", "smc N=1", "smc N=4"])
def test_ties_among_the_allowed_tokens_go_to_the_first(method):
    """The letters "b" and "d" tie for the largest allowed logit, above "c" and "e": "b"."""
    model = tied_lm()
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=5, stop_at_eos=False)
    out = decoder(method, (model, model), b_to_e()).decode(PROMPT, cfg, torch.Generator())
    assert out.tokens == [byte("b")] * 5


def nothing_after_two_tokens() -> TokenRule:
    """Anything but EOS for two tokens, then nothing at all."""

    def allowed(prefix: tuple[int, ...]) -> torch.Tensor:
        mask = torch.full((V,), len(prefix) < 2)
        mask[EOS] = False
        return mask

    return TokenRule(allowed, complete=lambda prefix: False)


@pytest.mark.parametrize("method", ["ar", "smc N=1", "smc N=4"])
def test_a_constraint_that_allows_nothing_is_still_a_dead_end_at_temperature_0(pair, method):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    with pytest.raises(ConstraintError, match="the constraint allows no next token"):
        decoder(method, pair, nothing_after_two_tokens()).decode(PROMPT, cfg, torch.Generator())


@pytest.mark.parametrize("method", ["ar", "smc N=4"])
@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_a_truncation_that_keeps_no_allowed_token_is_still_a_dead_end_above_0(
    pair, tokenizer, method, cut
):
    """Each cut keeps only the target's arg-max, which the constraint forbids: the settings'
    dead end, named as theirs, at T > 0 (at T = 0 truncation is moot)."""
    target, _ = pair
    best = int(target.logits(tuple(PROMPT)).argmax())
    other = next(t for t in (byte("a"), byte("b")) if t != best)
    pattern = chr(other - 1) + "+"
    only = Constraint.regex(pattern, tokenizer, V)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4, **cut)
    with pytest.raises(ConstraintError, match=r"sampling settings \(top_k, top_p, min_p"):
        decoder(method, pair, only).decode(PROMPT, cfg, torch.Generator())
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4, **cut)
    out = decoder(method, pair, only).decode(PROMPT, greedy, torch.Generator())
    assert out.tokens == oracle_greedy(target, pattern, greedy, tokenizer)[0]
