"""Pure functions from logits to the next-token law, and sampling from it.

The law every method targets is  softmax(logits / T)  restricted to the top-k tokens, then to the
smallest nucleus of mass >= top_p, renormalized (the order Hugging Face uses). T = 0 is greedy:
all mass on the arg-max token.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def log_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Normalized log-probabilities of the truncated, tempered law.  [..., V] -> [..., V].

    Computed in fp32 (fp64 if given fp64)."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    if temperature == 0:
        return _greedy(logits)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        scaled = _keep_top_k(scaled, top_k)
    if top_p < 1.0:
        scaled = _keep_top_p(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(logits, NEG_INF)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)


def _keep_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    # Exactly k survivors even under ties: mask by index, not by threshold value.
    top = scaled.topk(k, dim=-1).indices
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, top, True)
    return scaled.masked_fill(~keep, NEG_INF)


def _keep_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep token i (in descending order) while the mass strictly before it is < top_p, so the
    # token that crosses top_p stays in; the most likely token always stays (a top_p below
    # float32's smallest number would otherwise keep nothing).
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, NEG_INF)


def sample(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row by inverting the CDF with one uniform per row (cheaper than
    Gumbel-max over a 150k vocabulary). [..., V] -> [...] int64.

    A token of probability zero has the same CDF value as its predecessor, so `u < cdf[i]`
    first holds at a token of positive probability."""
    cdf = logp.double().exp().cumsum(dim=-1)  # [..., V]
    u = torch.rand(logp.shape[:-1], generator=generator, device=logp.device, dtype=torch.float64)
    total = cdf[..., -1]
    # scaled to the row's total (~1), kept strictly below it despite rounding
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)


def pick(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) for each row.  logp [..., V], tokens [...] -> [...]."""
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
