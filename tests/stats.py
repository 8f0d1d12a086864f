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
