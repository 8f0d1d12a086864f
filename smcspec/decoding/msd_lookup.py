"""msd with a lookup draft (`MSDConfig(proposal="lookup+draft")`, or "lookup", alike for msd):
the first of the N drafts is the text's own continuation where prompt lookup finds one
(`decoding.lookup`), the others come from the draft model as usual, and the tree is walked with
each draft's own law. (Where the lookup finds nothing, the round is msd's own, by its rule.)

The lookup draft is a point mass: at depth d < f (f the tokens the lookup found) its law is
delta_t, t its token there; past f, and for every other draft, it is the draft model's q. The
walk is SpecInfer's multi-round rule with one law per draft (Miao et al. 2023, which lets each
draft come from its own proposal): at a node with target law p, r = p, and the drafts alive
there, in the order 1..N, are tested

    accept x^j  w.p.  min(1, r(x^j) / q_j(x^j)),   else  r <- max(r - q_j, 0) / Z,

and a node where all are rejected draws from r. Why exact: given everything read before the
node, the alive drafts' tokens there are independent, each from its own q_j (the lookup's is a
function of the text, the model drafts' fresh draws). The first test keeps y with probability
min(r, q_1)(y) and leaves Z = sum (r - q_1)+; by induction on the drafts left, the rest emit y
with probability (r - q_1)+(y) / Z; in all r(y). For the point mass: kept with probability p(t),
else r becomes p without t, renormalized, against which the model drafts are tested. So every
node emits its token from p(. | path), and the bonus past depth K is a draw from p, as in `msd`.

With f = 0 this is `msd.verify`'s law, walked one test at a time: there the drafts at a node
share q, so the residual after m rejections has a closed form (`residual_scales`); here each
rejection updates r with its own draft's law, N passes over the vocabulary a depth, as the
closed form's. No host sync on a device: a test that does not run (an earlier draft kept, a
dead draft, a stopped walk) leaves every tensor as it was; on the CPU, where reading a flag
costs nothing, such tests and the depths after a stop are skipped. A round with a lookup draft
walks token by token under `verify="block"` too (each round's rule is exact, so their mix is).
"""

from __future__ import annotations

import torch

from smcspec import sampling


def verify(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk with one law per draft: drafts [N, k], logq [N, k, V] (row j's law at each of
    its tokens: a point mass where it is the lookup's), logp [N, k + 1, V], u [k N + 1] (the
    test of draft j at depth d takes u[d N + j], the final draw the last). Returns, as
    `msd.verify` does, the winner's path [k + 1], `depth` [] and `winner` []."""
    n, k = drafts.shape
    device = logp.device
    alive = torch.ones(n, dtype=torch.bool, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)
    depth = torch.zeros((), dtype=torch.long, device=device)
    winner = torch.zeros_like(depth)
    end = torch.zeros_like(logp[0, 0], dtype=torch.float64)  # the law the final draw takes
    on_host = device.type == "cpu"
    for d in range(k):
        if on_host and not bool(walking):
            break  # as in `msd.verify`: the depths left after a stop change nothing
        p = logp.index_select(0, winner[None])[0, d].double().exp()  # the node's target law
        r, kept = p, torch.full_like(depth, -1)
        for j in range(n):
            testing = walking & alive[j] & (kept < 0)
            if on_host and not bool(testing):
                continue  # a test that does not run leaves every tensor as it was
            q = logq[j, d].double().exp()
            x = drafts[j, d]
            passed = testing & (u[d * n + j] < r[x] / q[x])
            kept = torch.where(passed, j, kept)
            rest = (r - q).clamp_min(0)
            total = rest.sum()
            update = testing & ~passed
            r = torch.where(update, torch.where(total > 0, rest / total, p), r)
        stop = walking & (kept < 0)
        end = torch.where(stop, r, end)
        walking = walking & (kept >= 0)
        chosen = kept.clamp_min(0)
        alive = alive & (drafts[:, d] == drafts[:, d].gather(0, chosen[None]))
        depth = depth + walking.long()
        winner = torch.where(walking, chosen, winner)
    bonus = logp.index_select(0, winner[None])[0, k].double().exp()
    law = torch.where(walking, bonus, end)
    token = sampling.sample_at(law.log(), u[-1])
    path = torch.cat([drafts.index_select(0, winner[None])[0], token[None]])  # [k + 1]
    path = torch.where(torch.arange(k + 1, device=device) == depth, token, path)
    return path, depth, winner
