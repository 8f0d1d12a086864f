"""Statistical helpers shared by the tests: goodness of fit and log-log slopes."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from scipy import stats

# Every goodness-of-fit test runs at a fixed seed and rejects at this level: a correct sampler
# fails with probability 1e-4 per test, a wrong one (see the power checks) far more often.
ALPHA = 1e-4


def chi_square_pvalue(samples: Counter, law: dict, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of samples against an exact law. Cells with fewer than
    `min_expected` expected counts are pooled, as the chi-square approximation requires; a sample
    outside the law's support gives p = 0."""
    n = sum(samples.values())
    if any(law.get(x, 0.0) == 0.0 for x in samples):
        return 0.0
    observed, expected = [], []
    pooled_obs = pooled_exp = 0.0
    for x, prob in law.items():
        if n * prob >= min_expected:
            observed.append(samples.get(x, 0))
            expected.append(n * prob)
        else:
            pooled_obs += samples.get(x, 0)
            pooled_exp += n * prob
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected_arr = np.array(expected)
    expected_arr *= n / expected_arr.sum()  # absorb float rounding in the exact law
    chi2 = float(((np.array(observed) - expected_arr) ** 2 / expected_arr).sum())
    return float(stats.chi2.sf(chi2, df=len(expected) - 1))


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def l1(law_a: dict, law_b: dict) -> float:
    keys = set(law_a) | set(law_b)
    return math.fsum(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in keys)


def mean_l1_noise_bound(draws: np.ndarray, sigmas: float = 4.0) -> float:
    """How far the mean of R i.i.d. vectors draws [R, M] may lie from their expectation in L1,
    from sampling noise alone: E|mean_x - mu_x| ~ sqrt(2/pi) se_x per cell (normal limit), and
    the L1 sum's standard deviation is at most sqrt(sum (1 - 2/pi) se_x^2) for independent cells;
    `sigmas` of those bound a false alarm well below ALPHA. Multinomial draws (negatively
    correlated cells) only make the sum's spread smaller."""
    se = draws.std(axis=0, ddof=1) / math.sqrt(draws.shape[0])
    mean_abs = math.sqrt(2 / math.pi) * se.sum()
    spread = math.sqrt((1 - 2 / math.pi) * float((se**2).sum()))
    return float(mean_abs + sigmas * spread)


def mean_matches(draws: np.ndarray, expected: np.ndarray, min_count: float = 50.0) -> float:
    """Smallest Bonferroni-corrected p-value that the per-cell means of draws [R, M] equal
    `expected` [M] (two-sided z-tests with standard errors from the data). Cells whose expected
    share is below min_count / R are pooled into one, so each cell's mean has enough nonzero
    terms for its normal limit. Compare with ALPHA."""
    r = draws.shape[0]
    small = expected * r < min_count
    columns = [draws[:, ~small]]
    targets = [expected[~small]]
    if small.any():
        columns.append(draws[:, small].sum(axis=1, keepdims=True))
        targets.append(expected[small].sum(keepdims=True))
    x, mu = np.concatenate(columns, axis=1), np.concatenate(targets)
    se = x.std(axis=0, ddof=1) / math.sqrt(r)
    z = np.abs(x.mean(axis=0) - mu) / np.maximum(se, 1e-300)
    return float(min(1.0, x.shape[1] * 2 * stats.norm.sf(z.max())))


def rate_bound(l1_before: float, noise_before: float, n_before: int, n: int, noise: float) -> float:
    """The largest L1(mean measure, exact) at N = n that the paper's O(N^-1/2) bias rate allows,
    given the distance measured at n_before < n. The bias at n_before is at most its measured
    L1 plus that point's noise bound; the rate shrinks it by sqrt(n_before / n); the measured
    distance at n may exceed that only by its own noise bound (see mean_l1_noise_bound). A bias
    that stops falling (a plateau, the mark of a wrong sampler) does not fit."""
    return (l1_before + noise_before) * math.sqrt(n_before / n) + noise
