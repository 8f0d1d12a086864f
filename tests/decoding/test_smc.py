"""SMC speculative decoding against exactly enumerated laws.

Setup: 3 tokens (EOS + 2), at most 6 new tokens, K = 2 (two rounds of 3 tokens with a resampling
decision between them): 127 possible continuations, enumerated exactly. For each N in 1..64 we
run R independent decodes and keep each run's weighted particle measure  sum_i W_i delta(x_i),
whose expectation is exactly the law of smc's output (the output is drawn with probability W_i).
"""

import math

import numpy as np
import pytest
import torch

from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import SMCDecoder
from smcspec.decoding.smc import SMCDecoder as _SMC
from smcspec.models.toy import perturbed_lm, random_lm, sequence_law
from tests.stats import loglog_slope

PROMPT = [1]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=6)
NS = [1, 2, 4, 8, 16, 32, 64]
R = 2000
BOOTSTRAP = 200


@pytest.fixture(scope="module")
def pair():
    target = random_lm(3, seed=21, scale=1.5)
    return target, perturbed_lm(target, seed=22, noise=1.0)


class NoDraftCorrection(_SMC):
    """A classic bug for the power checks: weights use log p only, forgetting - log q."""

    def _propose(self, seqs, cache, k, s, generator, guide=None, ids=None):
        tokens, logq_x, dead = super()._propose(seqs, cache, k, s, generator, guide, ids)
        return tokens, torch.zeros_like(logq_x), dead


def weighted_runs(
    decoder_cls, target, draft, n, seed, law_index, threshold=0.5, scheme="systematic"
):
    """Per run: weighted measure over outcomes [R, M], estimate of E[length] [R], Z-hat [R]."""
    g = torch.Generator().manual_seed(seed)
    dec = decoder_cls(target, draft, SMCConfig(n, 2, threshold, scheme))
    measures = np.zeros((R, len(law_index)))
    lengths = np.zeros(R)
    z_hat = np.zeros(R)
    for r in range(R):
        out = dec.decode(PROMPT, CFG, g)
        for tokens, w in zip(out.particles, out.stats["weights"], strict=True):
            measures[r, law_index[tuple(tokens)]] += w
            lengths[r] += w * len(tokens)
        z_hat[r] = math.exp(out.stats["log_z_hat"])
    return measures, lengths, z_hat


def convergence(decoder_cls, target, draft):
    """Fitted log-log slopes of L1(law) and MSE(E[length]) over NS, and their bootstrap SEs."""
    law = sequence_law(target, PROMPT, CFG)
    index = {x: i for i, x in enumerate(law)}
    exact = np.array(list(law.values()))
    exact_len = float(sum(len(x) * p for x, p in law.items()))
    runs = [weighted_runs(decoder_cls, target, draft, n, seed=n, law_index=index) for n in NS]

    def slopes(pick):
        l1 = [np.abs(m[pick].mean(0) - exact).sum() for m, _, _ in runs]
        mse = [np.mean((e[pick] - exact_len) ** 2) for _, e, _ in runs]
        return loglog_slope(NS, l1), loglog_slope(NS, mse), l1, mse

    l1_slope, mse_slope, l1, mse = slopes(np.arange(R))
    rng = np.random.default_rng(0)
    boot = np.array([slopes(rng.integers(0, R, R))[:2] for _ in range(BOOTSTRAP)])
    return l1_slope, mse_slope, boot.std(0), l1, mse


def test_smc_error_shrinks_at_the_papers_rates(pair):
    """L1 bias O(N^-1/2), MSE O(N^-1).

    Tolerances: 3 bootstrap standard errors of each fitted slope (the statistical error of R runs
    per N). The MSE slope gets a further 0.1: the rate is asymptotic, and the self-normalized
    estimate's N x MSE rises towards its limit from below (measured here: 2.6 at N = 1, 3.3-3.7
    for N = 64..1024, i.e. a flattening of ~0.07 over this range). The power check below shows a
    biased sampler lands far outside both bounds.
    """
    target, draft = pair
    l1_slope, mse_slope, se, l1, mse = convergence(SMCDecoder, target, draft)
    print(f"L1 {np.round(l1, 4)} slope {l1_slope:.3f} +- {se[0]:.3f}")
    print(f"MSE {np.round(mse, 4)} slope {mse_slope:.3f} +- {se[1]:.3f}")
    assert l1_slope <= -0.5 + 3 * se[0]
    assert mse_slope <= -1.0 + 3 * se[1] + 0.1
    assert l1[-1] < 0.05


def test_power_a_biased_sampler_fails_the_rate_test(pair):
    target, draft = pair
    l1_slope, mse_slope, se, l1, _ = convergence(NoDraftCorrection, target, draft)
    assert l1_slope > -0.5 + 3 * se[0] or mse_slope > -1.0 + 3 * se[1] + 0.1
    assert l1[-1] > 0.1


@pytest.mark.parametrize("scheme", ["systematic", "multinomial", "stratified", "residual"])
@pytest.mark.parametrize("threshold", [0.5, 1.0])
def test_normalizing_constant_estimate_is_unbiased(pair, scheme, threshold):
    """The target is normalized, so E[Z-hat] = 1. 4 standard errors: false alarm < 1e-4."""
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    _, _, z_hat = weighted_runs(
        SMCDecoder,
        target,
        draft,
        4,
        seed=7,
        law_index={x: i for i, x in enumerate(law)},
        threshold=threshold,
        scheme=scheme,
    )
    se = z_hat.std() / math.sqrt(R)
    assert abs(z_hat.mean() - 1.0) <= 4 * se, (z_hat.mean(), se)


def test_power_z_hat_of_a_biased_sampler_is_caught(pair):
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    _, _, z_hat = weighted_runs(
        NoDraftCorrection, target, draft, 4, seed=7, law_index={x: i for i, x in enumerate(law)}
    )
    assert abs(z_hat.mean() - 1.0) > 4 * z_hat.std() / math.sqrt(R)


def test_draft_equal_to_target_keeps_uniform_weights():
    target = random_lm(4, seed=3)
    dec = SMCDecoder(target, target, SMCConfig(8, 3, 0.99))
    for seed in range(20):
        out = dec.decode(
            PROMPT, SamplingConfig(1.0, max_new_tokens=9), torch.Generator().manual_seed(seed)
        )
        assert out.stats["resamples"] == 0
        assert out.stats["ess"] == [pytest.approx(8.0)] * out.rounds
        assert out.stats["weights"] == [pytest.approx(1 / 8)] * 8
        assert out.stats["log_z_hat"] == pytest.approx(0.0, abs=1e-9)


def test_every_round_commits_k_plus_one_tokens(pair):
    target, draft = pair
    cfg = SamplingConfig(1.0, max_new_tokens=11, stop_at_eos=False)
    out = SMCDecoder(target, draft, SMCConfig(4, 3)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0)
    )
    assert out.rounds == 3  # 4 + 4 + 3: the last round drafts only what max_new_tokens allows
    assert all(len(p) == 11 for p in out.particles)


def test_finished_particles_stop_costing_forward_passes():
    # EOS is likely (logit +3), so particles finish at different times.
    base = random_lm(4, seed=5)
    target = type(base)(lambda pre: base.logits(pre) + torch.tensor([3.0, 0, 0, 0]), 4, {0})
    draft = type(base)(lambda pre: base.logits(pre) + torch.tensor([2.0, 0, 0, 0]), 4, {0})
    cfg = SamplingConfig(1.0, max_new_tokens=30)
    dec = SMCDecoder(target, draft, SMCConfig(16, 2, 0.0))
    out = dec.decode([1, 2], cfg, torch.Generator().manual_seed(1))
    assert target.batch_sizes[0] == 1  # the prompt is prefilled once, then shared by 16 rows
    verify_batches = target.batch_sizes[1:]
    live_after = [sum(len(p) > 3 * r + 3 for p in out.particles) for r in range(out.rounds)]
    assert verify_batches[0] == 16
    assert verify_batches[1:] == [n for n in live_after[:-1] if n > 0][: len(verify_batches) - 1]
    assert all(p[-1] == 0 or len(p) == 30 for p in out.particles)


def test_total_collapse_falls_back_to_an_exact_step():
    # top-k = 1 on both: wherever the draft's argmax differs from the target's every weight is 0.
    target = random_lm(4, seed=8)
    draft = perturbed_lm(target, seed=9, noise=3.0)
    cfg = SamplingConfig(1.0, top_k=1, max_new_tokens=8, stop_at_eos=False)
    greedy = sequence_law(target, PROMPT, cfg)
    out = SMCDecoder(target, draft, SMCConfig(4, 3)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0)
    )
    assert greedy == {tuple(out.tokens): pytest.approx(1.0)}
    assert out.stats["collapses"] > 0


def test_seed_reproduces_smc_exactly(pair):
    target, draft = pair
    dec = SMCDecoder(target, draft, SMCConfig(8, 2))
    a = [dec.decode(PROMPT, CFG, torch.Generator().manual_seed(s)).particles for s in range(20)]
    b = [dec.decode(PROMPT, CFG, torch.Generator().manual_seed(s)).particles for s in range(20)]
    assert a == b
