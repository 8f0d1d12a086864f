"""Every method reports, for each token it returns, the log-probability of that token under the
target's adjusted law at its place in the returned sequence, and the law's likeliest
alternatives; asking for them changes nothing that is sampled."""

import dataclasses
import math

import pytest
import torch

from smcspec.config import MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding import (
    AutoregressiveDecoder,
    MultiDraftDecoder,
    SMCDecoder,
    SpeculativeDecoder,
)
from smcspec.decoding.logprobs import ParticleLogprobs
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.potentials import Power
from tests.oracle import descending, position_law, token_scores

PROMPT = [1, 2]
TOP = 3
# Penalties make each token's law depend on the whole sequence before it, so a score taken at
# the wrong position or for the wrong particle shows.
CFG = SamplingConfig(
    temperature=1.0,
    max_new_tokens=12,
    stop_at_eos=False,
    repetition_penalty=1.5,
    frequency_penalty=0.5,
    logprobs=TOP,
)


@pytest.fixture(scope="module")
def pair():
    target = random_lm(6, seed=31, scale=1.5)
    return target, perturbed_lm(target, seed=32, noise=1.5)


def decoders(pair):
    target, draft = pair
    return {
        "ar": AutoregressiveDecoder(target),
        "sd": SpeculativeDecoder(target, draft, SDConfig(3)),
        # threshold 1: resampling after almost every round reorders the particles' scores
        "smc": SMCDecoder(target, draft, SMCConfig(4, 3, 1.0)),
        "smc with a potential": SMCDecoder(target, draft, SMCConfig(4, 3, 1.0), Power(2.0)),
        "msd": MultiDraftDecoder(target, draft, MSDConfig(3, 3)),
    }


def assert_scores_match(target, out, cfg: SamplingConfig) -> None:
    chosen, top = token_scores(target, PROMPT, out.tokens, cfg, TOP)
    assert len(out.logprobs) == len(out.tokens)
    torch.testing.assert_close(torch.tensor(out.logprobs.chosen), torch.tensor(chosen))
    for got, want in zip(out.logprobs.top, top, strict=True):
        torch.testing.assert_close(
            torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want])
        )
        values = dict(want)
        assert all(i in values for i, _ in got)  # the same tokens (ties aside)


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "smc with a potential", "msd"])
def test_each_returned_token_has_its_log_probability_under_the_target(pair, method):
    decoder = decoders(pair)[method]
    for seed in range(5):
        out = decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(seed))
        assert_scores_match(pair[0], out, CFG)


@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
def test_asking_for_logprobs_changes_nothing_sampled(pair, method):
    decoder = decoders(pair)[method]
    plain = dataclasses.replace(CFG, logprobs=None)
    for seed in range(5):
        a = decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(seed))
        b = decoder.decode(PROMPT, plain, torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens and a.particles == b.particles and b.logprobs is None


def test_an_exact_step_after_a_collapse_is_scored():
    """top-k = 1 on both and a far draft: rounds collapse to exact steps; every token is the
    target's arg-max, of log-probability 0."""
    target = random_lm(4, seed=8)
    draft = perturbed_lm(target, seed=9, noise=3.0)
    cfg = SamplingConfig(1.0, top_k=1, max_new_tokens=8, stop_at_eos=False, logprobs=1)
    out = SMCDecoder(target, draft, SMCConfig(4, 3)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0)
    )
    assert out.stats.collapses > 0
    assert out.logprobs.chosen == [0.0] * 8
    assert [top[0][0] for top in out.logprobs.top] == out.tokens


def test_power_scores_left_in_place_at_resampling_are_caught(pair, monkeypatch):
    """A population that resamples its tokens but not their scores reports another particle's
    log-probabilities."""
    monkeypatch.setattr(ParticleLogprobs, "reorder", lambda self, ancestors: None)
    decoder = decoders(pair)["smc"]
    with pytest.raises(AssertionError):
        for seed in range(5):
            out = decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(seed))
            assert_scores_match(pair[0], out, CFG)


def test_prompt_tokens_are_scored_given_the_tokens_before_them(pair):
    """`generate(..., prompt_logprobs=k)`: log p'(x_t | x_<t) for every prompt token after the
    first (one target pass over the prompt), under the same adjusted law."""
    from smcspec import LLM

    target, draft = pair
    prompt = [1, 2, 2, 4, 5, 2]
    cfg = dataclasses.replace(CFG, prompt_logprobs=2, logprobs=None)
    out = LLM.from_models(target, draft).generate(
        prompt,
        "sd",
        seed=0,
        temperature=1.0,
        repetition_penalty=cfg.repetition_penalty,
        frequency_penalty=cfg.frequency_penalty,  # counts generated tokens only: none here
        prompt_logprobs=2,
    )
    scores = out.prompt_logprobs
    assert len(scores) == len(prompt) and math.isnan(scores.chosen[0]) and scores.top[0] == []
    for t in range(1, len(prompt)):
        law = position_law(target, prompt[:t], len(prompt), cfg, temperature=1.0)
        assert scores.chosen[t] == pytest.approx(law[prompt[t]], abs=1e-6)
        assert [i for i, _ in scores.top[t]] == descending(law)[:2]
    assert out.logprobs is None
