"""AutoConfig's two formulas, written out: smc's rounds must keep chi^2 / N <= max_divergence,
and a round's mean ESS / N estimates 1 / (1 + chi^2), so the floor on ESS / N at N particles is
1 / (1 + max_divergence N), and `divergence` reads chi^2 / N back from a measured ESS / N."""

import pytest

from smcspec.config import AutoConfig


@pytest.mark.parametrize(
    ("max_divergence", "particles", "floor"),
    [
        (0.25, 4, 0.5),  # chi^2 = 1: ESS / N = 1 / 2
        (0.25, 1, 0.8),
        (0.25, 12, 0.25),  # chi^2 = 3
        (0.03, 2, 1 / 1.06),  # the default: 0.94 at N = 2, as docs/methods.md says
        (0.03, 4, 1 / 1.12),  # 0.89 at N = 4
        (0.0, 8, 1.0),  # no divergence allowed: every round must keep ESS = N
    ],
)
def test_the_ess_floor_is_one_over_one_plus_the_bound_times_n(max_divergence, particles, floor):
    assert AutoConfig(max_divergence=max_divergence).ess_floor(particles) == pytest.approx(
        floor, rel=1e-12
    )


@pytest.mark.parametrize("max_divergence", [0.03, 0.25, 2.0])
@pytest.mark.parametrize("particles", [2, 4, 8])
def test_the_divergence_at_the_floor_is_the_bound(max_divergence, particles):
    config = AutoConfig(max_divergence=max_divergence)
    floor = config.ess_floor(particles)
    assert config.divergence(floor, particles) == pytest.approx(max_divergence, rel=1e-12)


@pytest.mark.parametrize(
    ("ess_fraction", "particles", "divergence"),
    [(1.0, 4, 0.0), (0.5, 4, 0.25), (0.5, 1, 1.0), (0.25, 2, 1.5)],
)
def test_the_divergence_is_chi_square_over_n_from_the_mean_ess(ess_fraction, particles, divergence):
    # chi^2 = 1 / (ESS / N) - 1, then over N
    assert AutoConfig().divergence(ess_fraction, particles) == pytest.approx(divergence, rel=1e-12)
