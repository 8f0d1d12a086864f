"""`ar` and `sd` sample exactly the target's law over whole sequences.

Toy models with 4 tokens and at most 3 new tokens have 40 possible continuations (at most 5: 364),
so the law is enumerated exactly and R = 20,000 samples are compared with a Pearson chi-square
test at level ALPHA (fixed seeds, so the outcome is deterministic). sd with K drafts needs at
least K + 1 new tokens to draft K in a round, so K >= 3 runs with 5. The power checks show the
same test rejects a sampler that is wrong by as little as a temperature change, and the
plausible sd bugs of tests/decoding/broken.py.
"""

import dataclasses
from collections import Counter

import pytest
import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SDConfig
from smcspec.decoding import AutoregressiveDecoder, SpeculativeDecoder
from tests.decoding import broken
from tests.decoding.broken import SDOneUniformPerRound, SDWithoutResidual
from tests.decoding.conftest import PROMPT
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

R = 20000

SETTINGS = {
    "plain": SamplingConfig(temperature=1.0, max_new_tokens=3),
    "hot": SamplingConfig(temperature=1.4, max_new_tokens=3),
    "cool top-k": SamplingConfig(temperature=0.7, top_k=2, max_new_tokens=3),
    "top-p": SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=3),
    "draft at its own temperature": SamplingConfig(
        temperature=1.0, draft_temperature=0.5, max_new_tokens=3
    ),
    "ignore eos": SamplingConfig(temperature=1.0, max_new_tokens=3, stop_at_eos=False),
    # The draft's logits are adjusted alike; each position for its own context, drafts included.
    "penalties and bias": SamplingConfig(
        temperature=1.0,
        max_new_tokens=3,
        repetition_penalty=1.8,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={1: 1.5},
    ),
    "min-p": SamplingConfig(temperature=1.0, max_new_tokens=3, min_p=0.3),
}


# The broken samplers below are rejected at ALPHA from a quarter of R: rejecting from fewer
# samples is the stronger claim, and each saves three quarters of a full draw.
R_BROKEN = R // 4


def draw(decoder, cfg: SamplingConfig, seed: int, r: int = R) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(decoder.decode(PROMPT, cfg, g).tokens) for _ in range(r))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_ar_is_exact(target, name):
    cfg = SETTINGS[name]
    samples = draw(AutoregressiveDecoder(target), cfg, seed=1)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


def longer(cfg: SamplingConfig, max_new_tokens: int) -> SamplingConfig:
    return dataclasses.replace(cfg, max_new_tokens=max_new_tokens)


# A covering design, as msd's: every setting at some K, every K under several settings, and the
# settings that change the accept test (truncation, the draft's temperature) at two K each. The
# settings act on each position's laws alike whatever K is (a bug in one shows at any K), and a
# bug in the round's bookkeeping at a depth shows under any settings at a K that reaches it.
# K = 4 drafts 4 tokens only with 5 new tokens (364 outcomes, about twice the time per case).
ACCEPT_SETTINGS = ("plain", "cool top-k", "top-p", "draft at its own temperature")
CASES = (
    [("plain", 1), ("top-p", 1), ("draft at its own temperature", 1)]
    + [(name, 2) for name in SETTINGS if name not in ACCEPT_SETTINGS or name == "cool top-k"]
    + [(name, 4) for name in ACCEPT_SETTINGS]
)


@pytest.mark.parametrize(("name", "k"), CASES)
def test_sd_is_exact_with_a_far_draft(target, far_draft, name, k):
    cfg = SETTINGS[name] if k < 3 else longer(SETTINGS[name], k + 1)
    samples = draw(SpeculativeDecoder(target, far_draft, SDConfig(k)), cfg, seed=2)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


@pytest.mark.parametrize("k", [3, 4])
def test_sd_drafts_all_k_tokens_in_the_long_cases(target, k):
    """The K >= 3 cases above are real: with max_new_tokens = K + 1 a round drafts K tokens
    (a draft equal to the target accepts them all: one round, K proposed)."""
    cfg = longer(SamplingConfig(1.0, stop_at_eos=False), k + 1)
    out = SpeculativeDecoder(target, target, SDConfig(k)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0)
    )
    assert out.rounds == 1 and out.stats.proposed_tokens == k and len(out.tokens) == k + 1


def test_sd_is_exact_with_a_near_draft(target, near_draft):
    cfg = SETTINGS["plain"]
    samples = draw(SpeculativeDecoder(target, near_draft, SDConfig(2)), cfg, seed=3)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


def test_power_the_test_rejects_the_draft_law(target, far_draft):
    cfg = SETTINGS["plain"]
    samples = draw(AutoregressiveDecoder(far_draft), cfg, seed=4)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


def test_power_the_test_rejects_a_small_temperature_error(target):
    samples = draw(AutoregressiveDecoder(target), SamplingConfig(1.1, max_new_tokens=3), seed=5)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, SETTINGS["plain"])) < ALPHA


@pytest.mark.parametrize("bug", [SDWithoutResidual, SDOneUniformPerRound])
def test_power_plausible_sd_bugs_are_caught(target, far_draft, bug):
    cfg = longer(SETTINGS["plain"], 5)
    samples = draw(bug(target, far_draft, SDConfig(4)), cfg, seed=6, r=R_BROKEN)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


def test_greedy_sd_equals_greedy_ar(target, far_draft):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=3)
    g = torch.Generator().manual_seed(0)
    ar = AutoregressiveDecoder(target).decode(PROMPT, cfg, g).tokens
    law = sequence_law(target, PROMPT, cfg)
    assert law == {tuple(ar): 1.0}
    for k in (1, 3):
        assert (
            SpeculativeDecoder(target, far_draft, SDConfig(k)).decode(PROMPT, cfg, g).tokens == ar
        )


def test_seed_reproduces_sd_exactly(target, far_draft):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=3)
    dec = SpeculativeDecoder(target, far_draft, SDConfig(2))
    runs = [
        [dec.decode(PROMPT, cfg, torch.Generator().manual_seed(s)).tokens for s in range(50)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("bug", "method"),
    [(broken.adjust_counting_the_prompt, "ar"), (broken.adjust_with_stale_context, "sd")],
)
def test_power_wrong_penalty_contexts_are_caught(target, far_draft, monkeypatch, bug, method):
    """The penalties' realistic bugs: the prompt counted by presence / frequency (ar), and a
    verify pass scoring every position as if the round's drafts were not there (sd)."""
    cfg = SETTINGS["penalties and bias"]
    law = sequence_law(target, PROMPT, cfg)  # before the bug is in place
    monkeypatch.setattr(sampling, "adjust", bug)
    decoder = (
        AutoregressiveDecoder(target)
        if method == "ar"
        else SpeculativeDecoder(target, far_draft, SDConfig(2))
    )
    assert chi_square_pvalue(draw(decoder, cfg, seed=3, r=R_BROKEN), law) < ALPHA
