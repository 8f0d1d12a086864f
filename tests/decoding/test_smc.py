"""SMC speculative decoding against exactly enumerated laws.

Setup: 3 tokens (EOS + 2), at most 6 new tokens, K = 2 (two rounds of 3 tokens with a resampling
decision between them): 127 possible continuations, enumerated exactly. For each N in 1..64 we
run R independent decodes and keep, per run, the weighted particle measure m = sum_i W_i delta(x_i),
the returned sequence, and Z-hat. Three exact facts are tested:

- E[delta(returned)] = E[m] at any N (the answer is drawn with probability W_i);
- E[Z-hat m] = p at any N (SMC's unnormalized measure is unbiased; the target is normalized);
- E[m] -> p as N grows: L1 bias O(N^-1/2), MSE of a weighted mean O(N^-1) (the paper's rates).

At the default threshold 0.5 these runs hardly ever resample between the two rounds, so the first
two facts are also checked at threshold 1, where most runs do, under every resampling scheme.

Every test has a power check against a broken sampler from tests/decoding/broken.py.
"""

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import SMCDecoder, particles
from smcspec.decoding.base import SMCStats
from smcspec.decoding.population import Population
from smcspec.models.toy import ToyLM, perturbed_lm, random_lm
from tests.decoding import broken
from tests.decoding.broken import (
    NoDraftCorrection,
    UniformFinalDraw,
    WrongDraftTemperatureWeights,
    WrongWeightSign,
)
from tests.oracle import sequence_law
from tests.stats import (
    ALPHA,
    chi_square_pvalue,
    loglog_slope,
    mean_l1_noise_bound,
    mean_matches,
    rate_bound,
)

PROMPT = [1]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=6)
NS = [1, 2, 4, 8, 16, 32, 64]
# The MSE rate is asymptotic: a self-normalized weighted mean has N x MSE -> s^2 only once N
# exceeds the spread of the importance weights; before that N x MSE rises towards its limit
# (measured with the far draft of `pair`: 2.3, 2.5, 3.1, 3.3 at N = 4, 8, 16, 32). With the
# closer draft of `close_pair`, N x MSE is flat from N = 4 on (2.0-2.2), so the slope over
# N = 8..64 measures the rate itself, with no allowance.
NS_MSE = [8, 16, 32, 64]
R = 2000
BOOTSTRAP = 200

# One worker for the module: the `correct` runs (about a minute) are then drawn once, not once on
# each worker that gets a test using them.
pytestmark = pytest.mark.xdist_group("smc")


@pytest.fixture(scope="module")
def pair():
    target = random_lm(3, seed=21, scale=1.5)
    return target, perturbed_lm(target, seed=22, noise=1.0)


@pytest.fixture(scope="module")
def law(pair):
    return sequence_law(pair[0], PROMPT, CFG)


@dataclass
class Runs:
    """R independent decodes at one N."""

    measures: np.ndarray  # [R, M] weighted particle measure over the M outcomes
    lengths: np.ndarray  # [R] weighted mean length: the estimate of E_p[length]
    z_hat: np.ndarray  # [R]
    returned: Counter  # outcome -> times returned
    resampled_between_rounds: np.ndarray  # [R] bool: particles resampled before the last round

    def mean_measure(self) -> np.ndarray:
        return self.measures.mean(axis=0)


def decode_runs(
    decoder_cls,
    target,
    draft,
    smc: SMCConfig,
    law: dict,
    seed: int,
    cfg: SamplingConfig = CFG,
    runs: int = R,
) -> Runs:
    index = {x: i for i, x in enumerate(law)}
    g = torch.Generator().manual_seed(seed)
    dec = decoder_cls(target, draft, smc)
    out = Runs(
        np.zeros((runs, len(index))),
        np.zeros(runs),
        np.zeros(runs),
        Counter(),
        np.zeros(runs, dtype=bool),
    )
    for r in range(runs):
        result = dec.decode(PROMPT, cfg, g)
        for tokens, w in zip(result.particles, result.stats.weights, strict=True):
            if w == 0:  # a draft outside p's support (top-k / top-p): not in the law
                continue
            out.measures[r, index[tuple(tokens)]] += w
            out.lengths[r] += w * len(tokens)
        out.z_hat[r] = math.exp(result.stats.log_z_hat)
        out.returned[tuple(result.tokens)] += 1
        out.resampled_between_rounds[r] = resampled_between_rounds(result.stats, smc)
    return out


def resampled_between_rounds(stats: SMCStats, smc: SMCConfig) -> bool:
    """Whether a resampling came before the last round (whose copies the next round extends),
    not only after it: the decoder resamples after each round whose ESS is below threshold * N."""
    after_last = stats.ess[-1] < smc.resample_threshold * smc.particles
    return stats.resamples > after_last


def runs_over(decoder_cls, pair, law, ns) -> dict[int, Runs]:
    target, draft = pair
    return {n: decode_runs(decoder_cls, target, draft, SMCConfig(n, 2), law, seed=n) for n in ns}


@pytest.fixture(scope="module")
def correct(pair, law) -> dict[int, Runs]:
    return runs_over(SMCDecoder, pair, law, NS)


@pytest.fixture(scope="module")
def close_pair(pair):
    return pair[0], perturbed_lm(pair[0], seed=22, noise=0.5)


def exact_vector(law: dict) -> np.ndarray:
    return np.array(list(law.values()))


def l1_of_mean(runs: Runs, law: dict) -> float:
    return float(np.abs(runs.mean_measure() - exact_vector(law)).sum())


def final_l1_holds(before: Runs, last: Runs, law: dict) -> bool:
    """At the largest N the distance is what the O(N^-1/2) rate allows from N / 4, plus the
    sampling noise (see rate_bound). A bias that stops falling (0.1 L1, say) does not fit."""
    n_before, n = NS[-3], NS[-1]
    noise = mean_l1_noise_bound(before.measures), mean_l1_noise_bound(last.measures)
    bound = rate_bound(l1_of_mean(before, law), noise[0], n_before, n, noise[1])
    print(f"L1 at N = {n}: {l1_of_mean(last, law):.4f}, bound {bound:.4f}")
    return l1_of_mean(last, law) <= bound


def test_weighted_measure_converges_at_the_papers_rate(correct, law):
    """L1 bias O(N^-1/2): fitted slope within 3 bootstrap standard errors of -1/2 or steeper,
    and at N = 64 no distance left beyond the sampling noise."""
    exact = exact_vector(law)

    def slope(pick):
        return loglog_slope(
            NS, [np.abs(correct[n].measures[pick].mean(0) - exact).sum() for n in NS]
        )

    l1 = [l1_of_mean(correct[n], law) for n in NS]
    rng = np.random.default_rng(0)
    se = np.std([slope(rng.integers(0, R, R)) for _ in range(BOOTSTRAP)])
    print(f"L1 {np.round(l1, 4)} slope {slope(np.arange(R)):.3f} +- {se:.3f}")
    assert slope(np.arange(R)) <= -0.5 + 3 * se
    assert final_l1_holds(correct[NS[-3]], correct[NS[-1]], law)


def mse_slope(decoder_cls, close_pair, law) -> tuple[float, float]:
    """Log-log slope of the MSE of the weighted mean length over NS_MSE, and its bootstrap SE."""
    exact_len = math.fsum(len(x) * p for x, p in law.items())
    runs = runs_over(decoder_cls, close_pair, law, NS_MSE)

    def slope(pick):
        return loglog_slope(
            NS_MSE, [np.mean((runs[n].lengths[pick] - exact_len) ** 2) for n in NS_MSE]
        )

    rng = np.random.default_rng(0)
    se = float(np.std([slope(rng.integers(0, R, R)) for _ in range(BOOTSTRAP)]))
    return slope(np.arange(R)), se


def test_mse_of_a_weighted_mean_falls_as_one_over_n(close_pair, law):
    """MSE O(N^-1) over N = 8..64 (see NS_MSE), within 3 bootstrap standard errors."""
    slope, se = mse_slope(SMCDecoder, close_pair, law)
    print(f"MSE slope over N = {NS_MSE}: {slope:.3f} +- {se:.3f}")
    assert slope <= -1.0 + 3 * se


def test_power_a_sampler_without_the_draft_correction_fails_both_rates(pair, close_pair, law):
    slope, se = mse_slope(NoDraftCorrection, close_pair, law)
    assert slope > -1.0 + 3 * se
    before, last = runs_over(NoDraftCorrection, pair, law, [NS[-3], NS[-1]]).values()
    assert not final_l1_holds(before, last, law)


def returned_follows_weights(runs: Runs, law: dict) -> float:
    """Chi-square p-value of the returned sequences against the mean weighted measure.

    E[delta(returned)] = E[m] exactly, so R * mean(m) is the right expectation. Given the runs'
    particles the R returns are independent with covariance sum_r diag(m_r) - m_r m_r^T, which
    is below the multinomial covariance R (diag(mean m) - mean m mean m^T) used by Pearson's
    statistic: the test is conservative, never liberal, at any N."""
    expected = dict(zip(law, runs.mean_measure(), strict=True))
    return chi_square_pvalue(runs.returned, expected)


@pytest.mark.parametrize("n", NS[1:])
def test_the_returned_sequence_is_drawn_by_weight(correct, law, n):
    assert returned_follows_weights(correct[n], law) > ALPHA


def returned_l1(runs: Runs, law: dict) -> float:
    """L1 distance of the empirical law of the returned sequences to p."""
    r = sum(runs.returned.values())
    return math.fsum(abs(runs.returned.get(x, 0) / r - p) for x, p in law.items())


def returned_law_within_reach(runs: Runs, law: dict) -> bool:
    """L1(empirical law of returns, p) <= L1(mean m, p) + noise of the returns + noise of mean m
    (triangle inequality through E[returned] = E[m]; noise bounds at 4 standard deviations)."""
    index = {x: i for i, x in enumerate(law)}
    returns = np.zeros((sum(runs.returned.values()), len(law)))
    row = 0
    for x, count in runs.returned.items():
        returns[row : row + count, index[x]] = 1.0
        row += count
    distance = returned_l1(runs, law)
    bound = (
        l1_of_mean(runs, law) + mean_l1_noise_bound(returns) + mean_l1_noise_bound(runs.measures)
    )
    print(f"returned law L1 {distance:.3f}, bound {bound:.3f}")
    return distance <= bound


def test_the_returned_law_approaches_the_target_as_n_grows(correct, law):
    """The law of what `generate` returns is as close to p as the weighted measure (which the
    rate test drives to p), and the distance falls from N = 1 to N = 64."""
    distances = [returned_l1(correct[n], law) for n in NS]
    print(f"returned law L1 by N: {np.round(distances, 3)}")
    assert all(returned_law_within_reach(correct[n], law) for n in NS)
    assert distances[-1] < distances[0] / 2


def test_power_a_final_draw_that_ignores_the_weights_is_caught(pair, law):
    """Particles and weights are right; only the answer is picked uniformly."""
    target, draft = pair
    for n, seed in ((4, 40), (16, 41)):
        runs = decode_runs(UniformFinalDraw, target, draft, SMCConfig(n, 2), law, seed)
        assert returned_follows_weights(runs, law) < ALPHA
        assert not returned_law_within_reach(runs, law)


def unnormalized_measure_pvalue(runs: Runs, law: dict) -> float:
    """E[Z-hat m] = p at any N: per-outcome z-tests, Bonferroni-corrected."""
    return mean_matches(runs.z_hat[:, None] * runs.measures, exact_vector(law))


@pytest.mark.parametrize("bug", [NoDraftCorrection, WrongWeightSign])
def test_power_the_unnormalized_measure_test_rejects_wrong_weights(pair, law, bug):
    target, draft = pair
    runs = decode_runs(bug, target, draft, SMCConfig(4, 2), law, seed=50)
    assert unnormalized_measure_pvalue(runs, law) < ALPHA


def scaled(model: ToyLM, factor: float) -> ToyLM:
    """A draft with the target's logits times `factor`: the same ranking, so top-k keeps the
    same tokens, and with factor < 1 a flatter law whose nucleus (top-p) contains the target's.
    SMC needs q > 0 wherever p > 0; a truncated draft that cut a token p allows would bias it."""
    return ToyLM(
        lambda prefix: factor * model.logits(prefix), model.vocab_size, model.eos_token_ids
    )


SMALL_R = 1500
PENALIZED = SamplingConfig(
    1.0,
    max_new_tokens=6,
    repetition_penalty=1.8,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    logit_bias={1: 1.5},
)
# name: (sampling settings, draft from the target); each runs at N = 4.
SETTINGS = {
    "top-k": (SamplingConfig(1.0, top_k=2, max_new_tokens=6), lambda t: scaled(t, 0.6)),
    "top-p": (SamplingConfig(1.0, top_p=0.8, max_new_tokens=6), lambda t: scaled(t, 0.6)),
    "draft temperature": (
        SamplingConfig(1.0, draft_temperature=1.6, max_new_tokens=6),
        lambda t: perturbed_lm(t, seed=23, noise=0.7),
    ),
    "ignore eos": (
        SamplingConfig(1.0, max_new_tokens=5, stop_at_eos=False),
        lambda t: perturbed_lm(t, seed=24, noise=1.0),
    ),
    "penalties and bias": (PENALIZED, lambda t: perturbed_lm(t, seed=26, noise=1.0)),
    # a flatter draft: its min-p set holds the target's
    "min-p": (SamplingConfig(1.0, max_new_tokens=6, min_p=0.3), lambda t: scaled(t, 0.6)),
}


def settings_runs(decoder_cls, pair, name: str, seed: int) -> tuple[Runs, dict]:
    cfg, make_draft = SETTINGS[name]
    target = pair[0]
    law = sequence_law(target, PROMPT, cfg)
    runs = decode_runs(
        decoder_cls, target, make_draft(target), SMCConfig(4, 2), law, seed, cfg, SMALL_R
    )
    return runs, law


@pytest.mark.parametrize("name", list(SETTINGS))
def test_smc_is_right_under_every_setting(pair, name):
    """Cheap exact checks at N = 4: the unnormalized measure is unbiased for p under these
    settings (so weights, truncation and the bonus token are right), and the answer is drawn
    by weight."""
    runs, law = settings_runs(SMCDecoder, pair, name, seed=60)
    if name == "ignore eos":
        assert all(len(x) == 5 for x in runs.returned)
    assert unnormalized_measure_pvalue(runs, law) > ALPHA
    assert returned_follows_weights(runs, law) > ALPHA


def test_power_penalties_that_forget_the_drafts_are_caught(pair, monkeypatch):
    """SMC's target is the penalized law: a verify pass that scores each position without the
    drafts it follows weights (and draws bonus tokens) by the wrong law."""
    law = sequence_law(pair[0], PROMPT, PENALIZED)  # before the bug is in place
    monkeypatch.setattr(sampling, "adjust", broken.adjust_with_stale_context)
    draft = SETTINGS["penalties and bias"][1](pair[0])
    runs = decode_runs(SMCDecoder, pair[0], draft, SMCConfig(4, 2), law, 61, PENALIZED, SMALL_R)
    assert unnormalized_measure_pvalue(runs, law) < ALPHA


def test_power_weights_at_the_wrong_draft_temperature_are_caught(pair):
    runs, law = settings_runs(WrongDraftTemperatureWeights, pair, "draft temperature", seed=60)
    assert unnormalized_measure_pvalue(runs, law) < ALPHA


def resampling_runs(decoder_cls, pair, law: dict, scheme: str) -> Runs:
    """Threshold 1 resamples whenever the weights differ; with `pair`'s draft they differ after
    the first round in 72-82% of runs, by scheme (at threshold 0.5, in none of 300)."""
    target, draft = pair
    smc = SMCConfig(4, 2, 1.0, scheme)
    return decode_runs(decoder_cls, target, draft, smc, law, seed=62, runs=SMALL_R)


@pytest.mark.parametrize("scheme", list(particles.SCHEMES))
def test_smc_is_right_when_resampling_between_rounds(pair, law, scheme):
    """E[Z-hat m] = p and the answer drawn by weight, with the second round extending resampled
    copies in most runs. Ancestors drawn without the weights, or weights kept after resampling,
    bias the measure (the first leaves E[Z-hat] = 1)."""
    runs = resampling_runs(SMCDecoder, pair, law, scheme)
    share = runs.resampled_between_rounds.mean()
    print(f"{scheme}: resampled between rounds in {share:.0%} of runs")
    assert share > 0.5  # else a change has quietly stopped this test resampling between rounds
    assert unnormalized_measure_pvalue(runs, law) > ALPHA
    assert returned_follows_weights(runs, law) > ALPHA


@pytest.mark.parametrize("scheme", list(particles.SCHEMES))
def test_power_ancestors_that_ignore_the_weights_are_caught(pair, law, scheme, monkeypatch):
    monkeypatch.setattr(particles, "resample", broken.ancestors_ignoring_weights)
    runs = resampling_runs(SMCDecoder, pair, law, scheme)
    assert unnormalized_measure_pvalue(runs, law) < ALPHA


def test_power_weights_kept_after_resampling_are_caught(pair, law, monkeypatch):
    monkeypatch.setattr(Population, "resample", broken.resample_keeping_weights)
    runs = resampling_runs(SMCDecoder, pair, law, "systematic")
    assert unnormalized_measure_pvalue(runs, law) < ALPHA


@pytest.mark.parametrize("scheme", list(particles.SCHEMES))
def test_normalizing_constant_estimate_is_unbiased(pair, law, scheme, threshold=0.5):
    """The target is normalized, so E[Z-hat] = 1. 4 standard errors: false alarm < 1e-4.
    It cannot see which particles resampling keeps; the measure test above does."""
    target, draft = pair
    runs = decode_runs(SMCDecoder, target, draft, SMCConfig(4, 2, threshold, scheme), law, seed=7)
    se = runs.z_hat.std() / math.sqrt(R)
    assert abs(runs.z_hat.mean() - 1.0) <= 4 * se, (runs.z_hat.mean(), se)


def test_power_z_hat_of_a_biased_sampler_is_caught(pair, law):
    target, draft = pair
    runs = decode_runs(NoDraftCorrection, target, draft, SMCConfig(4, 2), law, seed=7)
    assert abs(runs.z_hat.mean() - 1.0) > 4 * runs.z_hat.std() / math.sqrt(R)


def test_draft_equal_to_target_keeps_uniform_weights():
    target = random_lm(4, seed=3)
    dec = SMCDecoder(target, target, SMCConfig(8, 3, 0.99))
    for seed in range(20):
        out = dec.decode(
            PROMPT, SamplingConfig(1.0, max_new_tokens=9), torch.Generator().manual_seed(seed)
        )
        assert out.stats.resamples == 0
        assert out.stats.ess == [pytest.approx(8.0)] * out.rounds
        assert out.stats.weights == [pytest.approx(1 / 8)] * 8
        assert out.stats.log_z_hat == pytest.approx(0.0, abs=1e-9)


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
    assert out.stats.collapses > 0


def test_seed_reproduces_smc_exactly(pair):
    target, draft = pair
    dec = SMCDecoder(target, draft, SMCConfig(8, 2))
    a = [dec.decode(PROMPT, CFG, torch.Generator().manual_seed(s)).particles for s in range(20)]
    b = [dec.decode(PROMPT, CFG, torch.Generator().manual_seed(s)).particles for s in range(20)]
    assert a == b
