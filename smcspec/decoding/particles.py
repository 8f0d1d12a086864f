"""Pure SMC helpers: weight normalization, effective sample size, resampling.

Each resampling scheme maps normalized weights W [N] to ancestor indices a [N] with
E[#{i : a_i = j}] = N W_j (unbiased), which is what keeps the normalizing-constant estimate
unbiased. Schemes differ only in variance: multinomial > stratified >= systematic; residual keeps
floor(N W_j) copies deterministically and draws the rest multinomially.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def normalize(log_w: torch.Tensor) -> torch.Tensor:
    """W_i = exp(log_w_i - logsumexp(log_w)).  [N] -> [N] fp64. Uniform if every weight is zero."""
    log_w = log_w.double()
    if torch.isneginf(log_w).all():
        return torch.full_like(log_w, 1.0 / log_w.numel())
    return torch.softmax(log_w, dim=0)


def ess(log_w: torch.Tensor) -> float:
    """Effective sample size 1 / sum_i W_i^2, in [1, N]."""
    w = normalize(log_w)
    return float(1.0 / (w * w).sum())


def log_mean_weight(log_w: torch.Tensor) -> float:
    """log( (1/N) sum_i exp(log_w_i) ): one factor of the normalizing-constant estimate Z-hat."""
    n = log_w.numel()
    return float(torch.logsumexp(log_w.double(), dim=0)) - math.log(n)


def multinomial(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """N independent draws from Categorical(W)."""
    n = weights.numel()
    return _inverse_cdf(weights, torch.rand(n, generator=generator, dtype=torch.float64).sort()[0])


def stratified(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One uniform draw in each stratum [i/N, (i+1)/N)."""
    n = weights.numel()
    u = torch.arange(n, dtype=torch.float64) + torch.rand(
        n, generator=generator, dtype=torch.float64
    )
    return _inverse_cdf(weights, u / n)


def systematic(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One shared uniform offset: points (i + U) / N. Each j gets floor or ceil of N W_j copies."""
    n = weights.numel()
    u = torch.arange(n, dtype=torch.float64) + torch.rand(
        1, generator=generator, dtype=torch.float64
    )
    return _inverse_cdf(weights, u / n)


def residual(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """floor(N W_j) deterministic copies of j, the remaining R draws from the residual weights."""
    n = weights.numel()
    expected = n * weights.double()
    counts = expected.floor().long()
    rest = n - int(counts.sum())
    if rest > 0:
        leftover = (expected - counts).clamp_min(0)
        extra = torch.multinomial(
            leftover / leftover.sum(), rest, replacement=True, generator=generator
        )
        counts += torch.bincount(extra, minlength=n)
    return torch.repeat_interleave(torch.arange(n), counts)


def _inverse_cdf(weights: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Ancestor index of each sorted point in [0, 1) under the CDF of W."""
    cdf = weights.double().cumsum(0)
    idx = torch.searchsorted(cdf, points, right=True)
    # Rounding can leave cdf[-1] a hair below 1: such points go to the last particle that has
    # weight, never to a zero-weight one.
    last_alive = int(torch.nonzero(weights > 0).max())
    return idx.clamp_max(last_alive)


SCHEMES: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "systematic": systematic,
    "multinomial": multinomial,
    "stratified": stratified,
    "residual": residual,
}


def resample(log_w: torch.Tensor, scheme: str, generator: torch.Generator) -> torch.Tensor:
    """Ancestor indices [N] (sorted ascending) drawn from the normalized weights of log_w [N]."""
    return SCHEMES[scheme](normalize(log_w), generator)
