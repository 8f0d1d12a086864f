"""sd's block verification (`verify="block"`): the device rule agrees with a plain loop of the
paper's Algorithm 2 on every input it is given, samples the target's law exactly over whole
sequences (the independent oracle, Pearson chi-square at ALPHA on R samples, as
test_exactness.py), and the test rejects three plausible bugs. K = 1 is the token rule."""

import dataclasses

import pytest
import torch

from smcspec.config import SDConfig
from smcspec.decoding import SpeculativeDecoder
from smcspec.decoding.speculative import _decide_block
from tests.decoding.broken import SDBlockBroken, block_walk
from tests.decoding.conftest import PROMPT
from tests.decoding.test_exactness import R_BROKEN, SETTINGS, R, draw, longer
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

BLOCK = "block"


def block(k: int) -> SDConfig:
    return SDConfig(k, verify=BLOCK)


def random_laws(k: int, vocab: int, seed: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(k + 1, vocab, generator=g) * spread, -1)
    logq = torch.log_softmax(torch.randn(k, vocab, generator=g) * spread, -1)
    drafts = torch.multinomial(logq.exp(), 1, generator=g)[:, 0]
    return drafts, logq, logp


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_the_device_rule_is_the_papers_loop(k):
    """Same tau and token as `broken.block_walk` (no bug) on 300 random rounds, each with its
    own uniforms: laws near and far apart, small vocabularies where drafts collide."""
    for seed in range(300):
        vocab = 3 + seed % 5
        drafts, logq, logp = random_laws(k, vocab, seed, spread=0.5 + (seed % 4))
        u = torch.rand(
            k + 1, generator=torch.Generator().manual_seed(10_000 + seed), dtype=torch.float64
        )
        tau, token = _decide_block(drafts, logq, logp, u)
        assert (int(tau), int(token)) == block_walk(drafts.tolist(), logq, logp, u), seed


def test_one_draft_is_the_token_rule():
    """K = 1: keep x with probability min(1, p/q), else draw from max(0, p - q): the same tau
    and token as the token rule at the same uniforms."""
    from smcspec.decoding.speculative import _decide

    for seed in range(200):
        drafts, logq, logp = random_laws(1, 5, seed, spread=2.0)
        u = torch.rand(2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        got = [int(v) for v in _decide_block(drafts, logq, logp, u)]
        assert got == [int(v) for v in _decide(drafts, logq, logp, u)], seed


# A covering design smaller than the token rule's (each case is a full R draw, 10-30 s): the
# laws' adjustments (truncation, penalties and bias, the draft's own temperature) enter the block
# rule through the same p and q as the token rule's, so one K each; the weight's walk across a
# round shows at K = 3 (4 new tokens, 121 outcomes).
CASES = [
    ("plain", 2),
    ("cool top-k", 2),
    ("penalties and bias", 2),
    ("draft at its own temperature", 2),
    ("top-p", 3),
]


@pytest.mark.parametrize(("name", "k"), CASES)
def test_block_sd_is_exact_with_a_far_draft(target, far_draft, name, k):
    cfg = SETTINGS[name] if k < 3 else longer(SETTINGS[name], k + 1)
    samples = draw(SpeculativeDecoder(target, far_draft, block(k)), cfg, seed=21)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


@pytest.mark.parametrize("bug", ["token residual", "first failure", "stale weight"])
def test_power_plausible_block_bugs_are_caught(target, far_draft, bug):
    """Each bug is rejected from a quarter of R at K = 3 (a round long enough for the weight
    to matter)."""
    cfg = longer(SETTINGS["plain"], 4)
    decoder = SDBlockBroken(target, far_draft, block(3), bug)
    samples = draw(decoder, cfg, seed=23, r=R_BROKEN)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


def test_block_keeps_at_least_the_token_rules_drafts(target, far_draft):
    """The paper's claim, on this pair: mean drafts kept per round, block >= token, over the
    same R rounds' worth of seeds (a difference of means, both from R decodes: the block rule
    must not fall below the token rule by more than 4 standard errors)."""
    cfg = dataclasses.replace(longer(SETTINGS["plain"], 4), stop_at_eos=False)
    kept = {}
    for rule in ("token", BLOCK):
        decoder = SpeculativeDecoder(target, far_draft, SDConfig(3, verify=rule))
        g = torch.Generator().manual_seed(24)
        per = [decoder.decode(PROMPT, cfg, g).stats.accepted_tokens for _ in range(R // 8)]
        mean = sum(per) / len(per)
        var = sum((v - mean) ** 2 for v in per) / (len(per) - 1)
        kept[rule] = (mean, var / len(per))
    (tm, tv), (bm, bv) = kept["token"], kept[BLOCK]
    assert bm - tm > -4 * (tv + bv) ** 0.5, kept
