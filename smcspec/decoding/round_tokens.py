"""Expected tokens a round commits, as a function of sd's acceptance probability at a drafted
position, a = sum_x min(p, q)(x) (the method table's `tokens_per_round` column reads these).

sd(K): drafts are accepted one after another, each w.p. a, until the first rejection; the round
commits the accepted ones plus one token (the residual's draw or the bonus):
    E[tokens] = sum_{d=0..K} a^d = (1 - a^(K+1)) / (1 - a)     (a = 1: K + 1).

msd(N, K): 1 + sum_{d=1..K} P(the tree walk passes depth d), in the case where the walk is
exactly this model: a target law that is a point mass x* at every node (greedy decoding, or a
confident target), so a = q(x*). A draft is then accepted exactly when its token is x* (r(x) = 0
elsewhere, and the residual stays on x* after a rejection), which happens w.p. a, independently
across drafts and depths. A node with m drafts alive passes w.p. 1 - (1 - a)^m, and the drafts
alive one level deeper are those that drew x*: Binomial(m, a), given at least one. A recursion
over the alive count gives P(pass depth d); at N = 1 it is sd's a^d. For other laws the real
walk differs both ways: once a draft is rejected the next is tested against the residual, which
accepts w.p. sum min(r, q), not a (higher when the residual sits where q has mass, lower when it
does not: p = (1/2, 1/2), q = (1, 0) has a = 1/2 and then 0, so 1 - (1 - a)^m is not a bound in
general); and drafts accepted at a node need not share a token, while only those that drew the
accepted one stay alive (fewer than here).

smc(N, K) commits K + 1 tokens whatever a is; ar one.
"""

from __future__ import annotations

import math


def sd_tokens_per_round(a: float, k: int) -> float:
    """E[tokens] of an sd round with K drafts: sum_{d=0..K} a^d."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def msd_tokens_per_round(a: float, n: int, k: int) -> float:
    """E[tokens] of an msd round with N drafts of K tokens, each draft's token the target's w.p.
    a independently (the module docstring's model): 1 + sum_d P(pass depth d)."""
    alive = [0.0] * n + [1.0]  # alive[m]: P(the walk reached this depth with m drafts alive)
    tokens = 1.0  # the round's last token: the residual's draw or the bonus
    for _ in range(k):
        deeper = [0.0] * (n + 1)
        for m, reached in enumerate(alive):
            for s in range(1, m + 1):  # s of the m drew the target's token
                deeper[s] += reached * math.comb(m, s) * a**s * (1 - a) ** (m - s)
        alive = deeper
        tokens += sum(alive)
    return tokens
