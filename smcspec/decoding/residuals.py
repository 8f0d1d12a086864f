"""The residual laws of multi-round speculative sampling in closed form (`msd`'s token walk and
its block rule, `msd_block`): what is left of a target law after drafts from q are rejected;
and what both walks start from (the drafts' p(x) and q(x), the round that drafted nothing)."""

from __future__ import annotations

import torch

from smcspec import sampling


def residual_scales(
    p: torch.Tensor, q: torch.Tensor, rejections: int, start: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, S) [rejections + 1, ...]: the residual after m rejections at a node of target law
    p [..., V] and draft law q [..., V] (probabilities) is r_m = (p - c_m q)+ / S_m, from
    c_0 = `start`: 0 for the node's own law (r_0 = p), 1 for a residual already taken once
    (block verification's, with p scaled by its weight). Induction:
    (r_m - q)+ = (p - (c_m + S_m) q)+ / S_m wherever p > c_m q, and 0 = (p - c_{m+1} q)+
    elsewhere. S_m = 0 (r_{m-1} = q, rounding only: its test would have kept the draft) leaves
    r_m undefined; `residual` then takes p, as sd does."""
    c = [torch.full(p.shape[:-1], start, dtype=p.dtype, device=p.device)]
    if start == 0:
        total = [torch.ones_like(c[0])]  # r_0 = p
    else:
        total = [torch.addcmul(p, c[0][..., None], q, value=-1).clamp_min_(0).sum(dim=-1)]
    for _ in range(rejections):
        c.append(c[-1] + total[-1])
        # p - c q in one pass, clamped in place: at a 152k vocabulary these float64 passes are
        # most of the walk's cost
        total.append(torch.addcmul(p, c[-1][..., None], q, value=-1).clamp_min_(0).sum(dim=-1))
    return torch.stack(c), torch.stack(total)


def residual(
    p: torch.Tensor, q: torch.Tensor, c: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """r = (p - c q)+ / S at the tokens (or whole laws) p, q [...] with c, S broadcast to them;
    p where S = 0."""
    return torch.where(total > 0, (p - c * q).clamp_min(0) / total, p)


def drafted_probs(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x) and q(x) [N, k] in float64 of each draft token x under its own row's laws, what
    both walks test: drafts [N, k], logq [N, k, V], logp [N, k + 1, V]."""
    k = drafts.shape[1]
    px = sampling.pick(logp[:, :k], drafts).double().exp()
    qx = sampling.pick(logq, drafts).double().exp()
    return px, qx


def undrafted(
    logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A walk's (path, depth, winner) for a round that drafted nothing (k = 0): one token drawn
    from row 0's target law by the round's one uniform."""
    token = sampling.sample_at(logp[0, 0], u[0])
    zero = torch.zeros((), dtype=torch.long, device=logp.device)
    return token[None], zero, zero
