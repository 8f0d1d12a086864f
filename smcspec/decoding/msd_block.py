"""msd's block rule (`MSDConfig(verify="block")`): block verification along one draft at a
time, and SpecInfer's multi-round residual test of the other drafts wherever it stops.

The rule composes two published exact rules: block verification for one draft (Sun et al.,
ICLR 2025; `speculative` has it, `speculative.block_stop`) and multi-round speculative sampling
over i.i.d. drafts (Miao et al., SpecInfer; `msd`'s token walk). It belongs to the family of
Thomas and Pal's greedy multi-path block verification (arXiv 2602.16961), but is not claimed to
be their algorithm: it is the composition below, with its own proof.

Each round, N drafts x^1..x^N of K tokens, i.i.d. from q, and the target's laws after every
prefix of every draft (the same verify pass as the token walk). Start on draft 1 at depth 0:

    1. Block-verify the active draft j from depth d0: its tokens x^j_{d0+1..K} against the laws
       along its row give tau and the weight w; the walk is at depth d = d0 + tau.
    2. d = K: draw the bonus token from p there; the round ends.
    3. Else draft j is spent (its test read its tokens past d). The drafts alive at d are those
       not spent whose first d tokens are the path's. Test them in the order 1..N as the token
       walk tests a node's drafts, but starting from the block rule's residual
       R = (w p - q)+ / S_0 instead of p: keep x^i_{d+1} with probability min(1, r(x)/q(x)),
       else r <- (r - q)+ / Z. The first kept draft becomes the active one at d0 = d + 1 (back
       to 1); if none is kept, draw the token from the last residual and end the round.

Why exact. Block verification's output is the target's law in this sense: its kept prefix and
the token it draws from R at the stop, followed by text drawn from p, is text drawn from p; and
the draw from R is a fresh draw, independent of everything else given (d, the path). Step 3
replaces that draw by another exact draw from R: the drafts alive at d carry tokens at d + 1
that are i.i.d. q(. | path) and independent of everything the walk has read (each draft is
independent of the others, whether it is alive depends only on its own first d tokens, and a
spent draft, whose later tokens the stop depended on, is never alive again), so SpecInfer's
argument (the `msd` docstring) applies with r_0 = R: the test sequence emits y with
probability R(y). If a draft i is kept at d + 1, its tokens past d + 1 are q-draws given the new
path, independent of the decisions so far (they read only its first d + 1 tokens and
uniforms), so block-verifying them from d0 = d + 1 is a fresh round of block verification from
that path: exact by the same theorem, and rounds of exact rules chain into text drawn from p.
Step 2's bonus is a draw from p, as in both rules.

The residual after m rejections keeps the closed form of `msd.residual_scales` with p scaled
by w and c_0 = 1: r_m = (w p - c_m q)+ / S_m, c_{m+1} = c_m + S_m. N = 1 is sd's block rule and
K = 1 is the token walk, uniform for uniform: draft j's test at depth d and the active draft's
eta at depth d both take u[d N + j] (a draft is tested at a depth, or active there, never
both), the final draw u[-1].

The walk reads the stop and the tests on the host (at most N + 1 reads a round): on the CPU
they cost nothing; on a GPU each is a wait, where the token walk has none.
"""

from __future__ import annotations

import torch

from smcspec import sampling
from smcspec.decoding.residuals import (
    drafted_probs,
    residual,
    residual_scales,
    undrafted,
)
from smcspec.decoding.speculative import block_stop


def verify(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk above, `msd.verify`'s signature: drafts [N, k], logq [N, k, V], logp
    [N, k + 1, V], u [k N + 1]. Returns the path [k + 1] (the active draft's tokens, then at
    index `depth` the drawn token), `depth` [] and the row that holds the path []."""
    n, k = drafts.shape
    if k == 0:
        return undrafted(logp, u)
    px, qx = drafted_probs(drafts, logq, logp)  # [N, k] each
    ids = torch.arange(n, device=drafts.device)
    spent = torch.zeros(n, dtype=torch.bool, device=drafts.device)
    active, start = 0, 0
    while True:
        depth, law = _stop(drafts, logq, logp, u, active, start)
        if law is None:  # every draft from start kept: the bonus from p
            token = sampling.sample_at(logp[active, k], u[-1])
            break
        scale, p, q = law
        spent[active] = True
        alive = ~spent & (drafts[:, :depth] == drafts[active, :depth]).all(dim=1)  # [N]
        c, total = residual_scales(scale * p, q, int(alive.sum()), start=1.0)
        ahead = alive.long().cumsum(0) - alive.long()  # [N] alive drafts tested before each
        ratio = residual(scale * px[:, depth], qx[:, depth], c[ahead], total[ahead])
        passed = alive & (u[depth * n + ids] < ratio / qx[:, depth])  # [N]
        if not bool(passed.any()):
            m = int(alive.sum())
            rest = residual(scale * p, q, c[m], total[m])
            token = sampling.sample_at(rest.log(), u[-1])
            break
        active, start = int(passed.long().argmax()), depth + 1
        if start == k:  # the kept draft was the last: the bonus follows
            depth = k
            token = sampling.sample_at(logp[active, k], u[-1])
            break
    path = torch.cat([drafts[active], token.reshape(1)])  # [k + 1]
    path[depth] = token
    return path, torch.tensor(depth, device=drafts.device), torch.tensor(active)


def _stop(
    drafts: torch.Tensor,
    logq: torch.Tensor,
    logp: torch.Tensor,
    u: torch.Tensor,
    active: int,
    start: int,
) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Block verification of the active draft's tokens from `start`: (the depth it stops at,
    and there (w, p, q) [], [V], [V] as float64 probabilities; None when it keeps them all)."""
    n, k = drafts.shape
    eta = u[start * n + active : k * n : n]  # [k - start]: the active draft's u at each depth
    tau, w, _ = block_stop(drafts[active, start:], logq[active, start:], logp[active, start:], eta)
    depth = start + int(tau)
    if depth == k:
        return depth, None
    p = logp[active, depth].double().exp()
    q = logq[active, depth].double().exp()
    return depth, (w, p, q)
