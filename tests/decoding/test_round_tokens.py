"""The expected tokens of a round: sd's formula against an exact enumeration of the accepted
length's law, msd's against a Monte Carlo of SpecInfer's tree walk where its model is exact."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from smcspec.decoding.round_tokens import msd_tokens_per_round, sd_tokens_per_round


def enumerated_sd_tokens(a: float, k: int) -> float:
    """E[tokens] of an sd round by summing over every accept/reject pattern of K positions, each
    accepted w.p. a independently: the round keeps drafts up to the first rejection, plus one."""
    total = 0.0
    for pattern in itertools.product((True, False), repeat=k):
        prob = math.prod(a if ok else 1 - a for ok in pattern)
        accepted = next((i for i, ok in enumerate(pattern) if not ok), k)
        total += prob * (accepted + 1)
    return total


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95, 1.0])
def test_sd_tokens_per_round_is_the_accepted_lengths_mean(a):
    for k in range(1, 7):
        assert sd_tokens_per_round(a, k) == pytest.approx(enumerated_sd_tokens(a, k), abs=1e-12)


def walked_tokens(p: list[float], q: list[float], n: int, k: int, rng: random.Random) -> int:
    """One msd round's committed tokens, by SpecInfer's walk (the test's own, from the issue's
    text) over N drafts of K tokens drawn from q, with the same laws p and q at every node."""
    drafts = [rng.choices(range(len(q)), q, k=k) for _ in range(n)]
    alive, depth = list(range(n)), 0
    while depth < k:
        r, accepted = list(p), None
        for j in alive:
            x = drafts[j][depth]
            if rng.random() < min(1.0, r[x] / q[x]):
                accepted = x
                break
            r = [max(ri - qi, 0.0) for ri, qi in zip(r, q, strict=True)]
            r = [ri / sum(r) for ri in r]
        if accepted is None:
            break
        alive = [j for j in alive if drafts[j][depth] == accepted]
        depth += 1
    return depth + 1


@pytest.mark.parametrize(("n", "k", "a"), [(2, 4, 0.5), (4, 4, 0.3), (8, 3, 0.15), (4, 6, 0.7)])
def test_msd_tokens_per_round_matches_the_walk_for_a_point_mass_target(n, k, a):
    """A point-mass target (p = delta_0, q(0) = a) is where the model is exact: the walk's mean
    over 10,000 rounds must agree within 5 standard errors."""
    rng = random.Random(1000 * n + k)
    p, q = [1.0, 0.0, 0.0], [a, (1 - a) / 2, (1 - a) / 2]
    tokens = [walked_tokens(p, q, n, k, rng) for _ in range(10_000)]
    mean = sum(tokens) / len(tokens)
    sd = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1))
    assert abs(msd_tokens_per_round(a, n, k) - mean) < 5 * sd / math.sqrt(len(tokens))


def test_msd_with_one_draft_is_sd():
    for a, k in itertools.product((0.0, 0.4, 0.9, 1.0), (1, 3, 8)):
        assert msd_tokens_per_round(a, 1, k) == pytest.approx(sd_tokens_per_round(a, k))
