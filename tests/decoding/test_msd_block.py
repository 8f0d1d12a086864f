"""msd's block rule (`MSDConfig(verify="block")`, `decoding.msd_block`): it commits what a
plain loop of the rule commits, uniform for uniform; it is sd's block rule at N = 1 and the
token walk at K = 1; it samples the target's law exactly over whole sequences (the independent
oracle, Pearson chi-square at ALPHA on R samples, as test_msd.py); and that test rejects two
plausible bugs of the rule (tests/decoding/broken.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from smcspec.config import MSDConfig, SamplingConfig, SDConfig
from smcspec.decoding import MultiDraftDecoder, SpeculativeDecoder
from tests.decoding import broken
from tests.decoding.conftest import PROMPT
from tests.decoding.test_msd import PENALTIES, R, draw
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

BLOCK = "block"


def block(n: int, k: int) -> MSDConfig:
    return MSDConfig(n, k, verify=BLOCK)


# (N, K, settings) where the walk and the loop could part: hot drafts (many stops and switches),
# truncation and penalties in both laws, greedy ties, long rounds without EOS.
WALKS = [
    (3, 3, SamplingConfig(1.0, draft_temperature=2.0, max_new_tokens=7)),
    (4, 3, SamplingConfig(0.7, top_k=2, max_new_tokens=7)),
    (4, 2, SamplingConfig(1.0, top_p=0.7, max_new_tokens=7, **PENALTIES)),
    (3, 3, SamplingConfig(0.0, draft_temperature=1.0, max_new_tokens=7)),
    (5, 4, SamplingConfig(1.0, max_new_tokens=9, stop_at_eos=False)),
]


@pytest.mark.parametrize(("n", "k", "cfg"), WALKS)
def test_the_block_walk_is_the_plain_loop(target, far_draft, n, k, cfg):
    """Same seed, same uniforms: `msd_block.verify` (closed-form residuals, the tests of a stop
    at once) commits what `broken.multipath_walk` (one test at a time) commits."""
    fast = MultiDraftDecoder(target, far_draft, block(n, k))
    plain = broken.MSDBlockReference(target, far_draft, block(n, k))
    for seed in range(30):
        a = fast.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        b = plain.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens and a.stats == b.stats, seed


def test_one_draft_is_sds_block_rule_and_one_token_the_token_walk(target, far_draft):
    """N = 1: the tokens of sd with `verify="block"`; K = 1: those of msd's token walk; seed
    for seed (the same uniforms read in the same places)."""
    cfg = SamplingConfig(1.0, draft_temperature=1.5, max_new_tokens=7, stop_at_eos=False)
    pairs = [
        (block(1, 3), SpeculativeDecoder(target, far_draft, SDConfig(3, verify=BLOCK))),
        (block(4, 1), MultiDraftDecoder(target, far_draft, MSDConfig(4, 1))),
    ]
    for config, other in pairs:
        ours = MultiDraftDecoder(target, far_draft, config)
        for seed in range(30):
            a = ours.decode(PROMPT, cfg, torch.Generator().manual_seed(seed)).tokens
            b = other.decode(PROMPT, cfg, torch.Generator().manual_seed(seed)).tokens
            assert a == b, (config, seed)


# (N, K) -> settings: switches between drafts need N >= 2 and K >= 2; K = 3 with 4 new tokens
# lets a round stop, switch and stop again; the adjusted laws enter as the token walk's do.
CASES = {
    (2, 2): SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=3),
    (4, 2): SamplingConfig(temperature=1.0, max_new_tokens=3, **PENALTIES),
    (3, 3): SamplingConfig(temperature=1.0, draft_temperature=2.0, max_new_tokens=4),
}


@pytest.mark.parametrize(("n", "k"), list(CASES), ids=[f"N{n}-K{k}" for n, k in CASES])
def test_msd_block_is_exact_with_a_far_draft(target, far_draft, n, k):
    cfg = CASES[n, k]
    samples = draw(MultiDraftDecoder(target, far_draft, block(n, k)), cfg, seed=31)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


BUGS = [broken.MSDBlockReusesStoppedDraft, broken.MSDBlockTokenResidual]


@pytest.mark.parametrize("bug", BUGS, ids=[b.__name__ for b in BUGS])
def test_power_plausible_msd_block_bugs_are_caught(target, far_draft, bug):
    """Each bug is rejected from a fifth of the exactness tests' R samples."""
    cfg = dataclasses.replace(CASES[3, 3], draft_temperature=None)
    samples = draw(bug(target, far_draft, block(3, 3)), cfg, seed=32, r=R // 5)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA
