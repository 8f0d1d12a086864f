"""SMC towards p(x) phi(x) / Z against exactly enumerated targets on a toy model.

3 tokens (EOS = 0 and two others), at most 4 new tokens, K = 2: every continuation is
enumerated. For each N, R independent runs; the mean of the weighted particle measures
sum_i W_i delta(x_i) is the law of smc's output. Its L1 distance to the exact target must shrink
with N at the paper's O(N^-1/2) rate (3 bootstrap standard errors), and end far below the bias
of the naive local method (per-token tempering or masking) where that differs.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import AutoregressiveDecoder, SMCDecoder
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.potentials import Power, Reward, TokenRule
from tests.decoding.broken import ForgetsBonusNormalizer
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
CFG = SamplingConfig(temperature=1.0, max_new_tokens=4)
NS = [2, 8, 32, 128]
R = 600
BOOTSTRAP = 200


@pytest.fixture(scope="module")
def pair():
    target = random_lm(3, seed=31, scale=1.5)
    return target, perturbed_lm(target, seed=32, noise=0.7)


def no_repeat_of_two() -> TokenRule:
    """Token 2 never follows token 2, and a sequence must end with EOS (cut ones are invalid)."""

    def allowed(prefix):
        mask = torch.ones(3, dtype=torch.bool)
        if prefix and prefix[-1] == 2:
            mask[2] = False
        return mask

    return TokenRule(allowed, complete=lambda prefix: False)


def count_twos(tokens, final):
    return float(sum(t == 2 for t in tokens))


def exact_target(law, potential_fn):
    weights = {x: p * potential_fn(x) for x, p in law.items()}
    z = math.fsum(weights.values())
    return {x: w / z for x, w in weights.items()}


def rule_ok(x):
    return all(not (a == 2 and b == 2) for a, b in itertools.pairwise(x)) and (
        len(x) > 0 and x[-1] == 0
    )


CASES = {
    "power": (lambda: Power(2.0), lambda x, p: p),  # phi = p^(alpha - 1)
    "rule": (no_repeat_of_two, lambda x, p: float(rule_ok(x))),
    "reward": (lambda: Reward(count_twos, beta=0.8), lambda x, p: math.exp(0.8 * x.count(2))),
    "twisted reward": (
        lambda: Reward(count_twos, beta=0.8, every=2),
        lambda x, p: math.exp(0.8 * x.count(2)),
    ),
    "product": (
        lambda: Power(2.0) * no_repeat_of_two() * Reward(count_twos, beta=-0.5),
        lambda x, p: p * float(rule_ok(x)) * math.exp(-0.5 * x.count(2)),
    ),
}


def weighted_measures(target, draft, potential, n, seed, index, cls=SMCDecoder):
    g = torch.Generator().manual_seed(seed)
    dec = cls(target, draft, SMCConfig(n, 2, 0.5), potential)
    out_measures = np.zeros((R, len(index)))
    for r in range(R):
        out = dec.decode(PROMPT, CFG, g)
        for tokens, w in zip(out.particles, out.stats.weights, strict=True):
            if w > 0:
                out_measures[r, index[tuple(tokens)]] += w
    return out_measures


@pytest.mark.parametrize("case", list(CASES))
def test_smc_converges_to_the_exact_target(pair, case):
    make, factor = CASES[case]
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    exact = exact_target(law, lambda x: factor(x, law[x]))
    index = {x: i for i, x in enumerate(law)}
    exact_vec = np.array([exact[x] for x in law])
    runs = [weighted_measures(target, draft, make(), n, seed=n, index=index) for n in NS]

    def fit(pick):
        l1 = [np.abs(m[pick].mean(0) - exact_vec).sum() for m in runs]
        return loglog_slope(NS, l1), l1

    slope, l1 = fit(np.arange(R))
    rng = np.random.default_rng(0)
    se = np.std([fit(rng.integers(0, R, R))[0] for _ in range(BOOTSTRAP)])
    print(f"{case}: L1 {np.round(l1, 4)} slope {slope:.3f} +- {se:.3f}")
    assert slope <= -0.5 + 3 * se
    assert all(b < a for a, b in itertools.pairwise(l1))
    bound = final_bound(runs, l1)
    print(f"{case}: L1 at N = {NS[-1]} {l1[-1]:.4f}, bound {bound:.4f}")
    assert l1[-1] <= bound


def final_bound(runs, l1) -> float:
    """What the O(N^-1/2) rate and the sampling noise allow at the largest N (see rate_bound)."""
    noise = [mean_l1_noise_bound(m) for m in runs[-2:]]
    return rate_bound(l1[-2], noise[0], NS[-2], NS[-1], noise[1])


def test_power_a_plateau_fails_the_final_bound(pair):
    """Dropping the bonus token's normalizer leaves a bias that does not fall with N."""
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    exact = exact_target(law, lambda x: law[x])
    index = {x: i for i, x in enumerate(law)}
    exact_vec = np.array([exact[x] for x in law])
    runs = [
        weighted_measures(
            target, draft, Power(2.0), n, seed=n, index=index, cls=ForgetsBonusNormalizer
        )
        for n in NS[-2:]
    ]
    l1 = [np.abs(m.mean(0) - exact_vec).sum() for m in runs]
    assert l1[-1] > final_bound(runs, l1)


def z_hats(decoder_cls, target, draft, potential, runs=4000, index=None):
    """Z-hat of `runs` decodes at N = 4 [runs] and, given an outcome index, Z-hat times each
    run's weighted particle measure [runs, M]."""
    dec = decoder_cls(target, draft, SMCConfig(4, 2, 0.5), potential)
    g = torch.Generator().manual_seed(1)
    zs = np.zeros(runs)
    scaled = np.zeros((runs, len(index or ())))
    for r in range(runs):
        out = dec.decode(PROMPT, CFG, g)
        zs[r] = math.exp(out.stats.log_z_hat)
        for tokens, w in zip(out.particles, out.stats.weights, strict=True):
            if index is not None and w > 0:
                scaled[r, index[tuple(tokens)]] += zs[r] * w
    return (zs, scaled) if index is not None else zs


@pytest.mark.parametrize("case", list(CASES))
def test_normalizing_constant_of_the_unnormalized_target_is_unbiased(pair, case):
    """E[Z-hat] = Z = sum_x p(x) phi(x) for any N; 4 standard errors (false alarm < 1e-4). And
    outcome by outcome, E[Z-hat m] = p(x) phi(x) at any N (SMC's unnormalized measure is
    unbiased), which a bias in any particle's weight breaks."""
    make, factor = CASES[case]
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    unnormalized = np.array([law[x] * factor(x, law[x]) for x in law])
    index = {x: i for i, x in enumerate(law)}
    zs, scaled = z_hats(SMCDecoder, target, draft, make(), index=index)
    z = math.fsum(unnormalized)
    assert abs(zs.mean() - z) <= 4 * zs.std() / math.sqrt(len(zs)), (zs.mean(), z)
    assert mean_matches(scaled, unnormalized) > ALPHA


def test_power_check_a_dropped_normalizer_is_caught(pair):
    target, draft = pair
    law = sequence_law(target, PROMPT, CFG)
    z = math.fsum(p * p for p in law.values())
    zs = z_hats(ForgetsBonusNormalizer, target, draft, Power(2.0))
    assert abs(zs.mean() - z) > 4 * zs.std() / math.sqrt(len(zs))


def test_power_is_not_local_tempering(pair):
    """The sequence-level p^alpha and per-token temperature 1/alpha differ on this model, and
    ar with Power samples the local one (chi-square)."""
    target, _ = pair
    law = sequence_law(target, PROMPT, CFG)
    exact = exact_target(law, lambda x: law[x] ** 2)
    local = sequence_law(target, PROMPT, CFG, temperature=1 / 2)
    assert sum(abs(exact[x] - local.get(x, 0.0)) for x in exact) > 0.1
    dec = AutoregressiveDecoder(target, Power(2.0))
    g = torch.Generator().manual_seed(5)
    from collections import Counter

    counts = Counter(tuple(dec.decode(PROMPT, CFG, g).tokens) for _ in range(5000))
    assert chi_square_pvalue(counts, local) > ALPHA


def test_masked_ar_samples_the_locally_masked_law_not_the_conditional(pair):
    target, _ = pair
    law = sequence_law(target, PROMPT, CFG)
    exact = exact_target(law, lambda x: float(rule_ok(x)))
    dec = AutoregressiveDecoder(target, no_repeat_of_two())
    g = torch.Generator().manual_seed(6)
    from collections import Counter

    samples = [tuple(dec.decode(PROMPT, CFG, g).tokens) for _ in range(5000)]
    valid = [x for x in samples if rule_ok(x)]
    assert all(not (a == 2 and b == 2) for x in samples for a, b in itertools.pairwise(x))
    # masking never repeats 2, but cannot see the end: some runs are cut before EOS, and the
    # valid ones follow a different law than the exact conditional
    assert len(valid) < len(samples)
    assert chi_square_pvalue(Counter(valid), exact) < ALPHA


def test_a_reward_that_raises_on_one_particle_keeps_the_others(pair):
    target, draft = pair

    def picky(tokens, final):
        if tokens and tokens[0] == 2:
            raise RuntimeError("cannot score this one")
        return 1.0

    dec = SMCDecoder(target, draft, SMCConfig(8, 2, 0.5), Reward(picky))
    out = dec.decode(PROMPT, CFG, torch.Generator().manual_seed(0))
    bad = [i for i, x in enumerate(out.particles) if x and x[0] == 2]
    assert bad and out.stats.potential_errors
    assert all(out.stats.weights[i] == 0 for i in bad)
    assert out.stats.valid_particles == 8 - len(bad) > 0
    assert out.tokens[:1] != [2]


def test_reward_is_refused_by_ar_and_bad_settings_are_value_errors(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="reward needs smc"):
        AutoregressiveDecoder(target, Reward(count_twos))
    with pytest.raises(ValueError, match="alpha"):
        Power(0)
    with pytest.raises(ValueError, match="beta"):
        Reward(count_twos, beta=float("nan"))
    with pytest.raises(ValueError, match="every"):
        Reward(count_twos, every=0)


@pytest.mark.parametrize("alpha", [5e-324, 1e-45, 0.5, 64.0])
def test_shaping_keeps_zero_probabilities_zero_at_any_alpha(alpha):
    """log 0 * alpha must stay -inf: an alpha that underflows to 0 in float32 made it NaN, and
    sampling from a NaN law returned an index past the vocabulary (found by fuzzing the
    server with a greedy draft and power_alpha=5e-324)."""
    from smcspec import sampling
    from smcspec.decoding.guide import Guide

    logr = sampling.log_probs(torch.tensor([[0.3, 2.0, -1.0, 0.5]]), temperature=0)  # greedy
    logg, norm = Guide(Power(alpha), 1).shaped([0], logr)
    assert not torch.isnan(logg).any() and torch.isfinite(norm).all()
    assert torch.equal(torch.isneginf(logg), torch.isneginf(logr))
    token = sampling.sample(logg, torch.Generator().manual_seed(0))
    assert int(token) == 1
