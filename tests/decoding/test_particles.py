import math

import pytest
import torch

from smcspec.decoding import particles

WEIGHTS = torch.tensor([0.05, 0.0, 0.4, 0.3, 0.25], dtype=torch.float64)
DRAWS = 20000


def test_normalize_and_ess():
    log_w = torch.tensor([0.0, 0.0, 0.0, 0.0])
    assert particles.ess(log_w) == pytest.approx(4.0)
    one_hot = torch.tensor([0.0, -math.inf, -math.inf])
    assert particles.ess(one_hot) == pytest.approx(1.0)
    w = particles.normalize(torch.tensor([math.log(1.0), math.log(3.0)]))
    torch.testing.assert_close(w, torch.tensor([0.25, 0.75], dtype=torch.float64))


def test_normalize_all_zero_weights_is_uniform():
    w = particles.normalize(torch.full((3,), -math.inf))
    torch.testing.assert_close(w, torch.full((3,), 1 / 3, dtype=torch.float64))


def test_log_mean_weight():
    log_w = torch.tensor([math.log(1.0), math.log(3.0)])
    assert particles.log_mean_weight(log_w) == pytest.approx(math.log(2.0))


def ancestor_counts(scheme: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    log_w = WEIGHTS.log()
    counts = [
        torch.bincount(particles.resample(log_w, scheme, g), minlength=5) for _ in range(DRAWS)
    ]
    return torch.stack(counts).double()  # [DRAWS, N]


@pytest.mark.parametrize("scheme", list(particles.SCHEMES))
def test_ancestor_counts_are_unbiased(scheme):
    counts = ancestor_counts(scheme)
    n = WEIGHTS.numel()
    assert (counts.sum(dim=1) == n).all()
    assert (counts[:, 1] == 0).all(), "a zero-weight particle was resampled"
    mean, se = counts.mean(0), counts.std(0) / math.sqrt(DRAWS)
    expected = n * WEIGHTS
    # 4 standard errors: a correct scheme fails one of these 5 coordinates w.p. < 3e-4; a
    # deterministic scheme coordinate has se = 0 and must match to rounding.
    assert ((mean - expected).abs() <= 4 * se + 1e-9).all(), (scheme, mean, expected)


@pytest.mark.parametrize("scheme", ["systematic", "stratified", "residual"])
def test_low_variance_schemes_keep_floor_copies(scheme):
    counts = ancestor_counts(scheme, seed=1)
    expected = 5 * WEIGHTS
    assert (counts >= expected.floor() - (1 if scheme == "stratified" else 0)).all()
    if scheme == "systematic":
        assert (counts <= expected.ceil()).all()


def test_biased_scheme_would_be_caught():
    # power check for the unbiasedness test: "keep the heaviest particle N times" is biased
    counts = torch.zeros(DRAWS, 5, dtype=torch.float64)
    counts[:, 2] = 5
    mean, se = counts.mean(0), counts.std(0) / math.sqrt(DRAWS)
    assert not ((mean - 5 * WEIGHTS).abs() <= 4 * se + 1e-9).all()


def test_resampling_is_reproducible():
    log_w = WEIGHTS.log()
    a = particles.resample(log_w, "multinomial", torch.Generator().manual_seed(7))
    b = particles.resample(log_w, "multinomial", torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
