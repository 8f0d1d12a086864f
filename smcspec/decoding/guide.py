"""What a potential adds to a decoder: per-particle states, shaped proposal laws and weights.

Target: pi(x) = p(x)^alpha * 1[x allowed] * exp(v(x)) / Z, alpha = 1 + potential.exponent.
- A token y drawn from a shaped law  g(y) = exp(z(y)) / sum exp(z),  z = alpha log r + log mask
  (r = the draft q for proposals, the target p for bonus tokens) is weighted by
  alpha log p(y) - log g(y): the target's factor over the proposal's probability. For a bonus
  token (r = p) that is log sum_y exp(z(y)), the local normalizer, whatever y was drawn.
- The sequence factor enters as v(prefix) - v(previous prefix) after every round; at the end
  v(x, final) - v(last prefix), so the intermediate values telescope away.
- At T = 0 a shaped law is the point mass on the arg-max of the logits among the allowed tokens
  (`Guide.shaped`, greedy): the limit T -> 0 of the shaped law, the same for every alpha.
- A particle whose mask allows nothing, whose reward raises, or that ends incomplete gets
  weight zero (log -inf); the other particles carry on. Why each dead end happened is kept in
  `errors`; a decode all of whose sequences end in one raises `dead_end()`.
"""

from __future__ import annotations

from typing import Any

import torch

from smcspec import sampling
from smcspec.potentials import ConstraintError, Potential, release_heap

NEG_INF = float("-inf")
SETTINGS_DEAD_END = (
    "the sampling settings (top_k, top_p, min_p, logit_bias, penalties, or a temperature above 0 "
    "so small that its law is the unconstrained greedy one) leave none of the tokens the "
    "constraint allows"
)


class Guide:
    def __init__(self, potential: Potential, n: int) -> None:
        self.potential = potential
        self.alpha = 1.0 + potential.exponent
        self.states: list[Any] = [potential.start() for _ in range(n)]
        self.value = torch.zeros(n, dtype=torch.float64)  # last v(prefix) per particle
        self.errors: list[str] = []  # why particles died, each reason once
        self.died = torch.zeros(n, dtype=torch.bool)  # [N] a dead end is recorded

    def shaped(
        self,
        particles: list[int],
        logr: torch.Tensor,
        greedy: bool = False,
        masks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log g [B, V], log normalizer [B]) for z = alpha log r + log mask, per particle's
        state. A row whose mask allows nothing comes back all -inf with normalizer -inf.
        masks: the rows' `masks`, when the caller has them already.

        greedy: a T = 0 step. logr are then its scores l (`sampling.scores`: the logits after
        logit bias and penalties), and g is the point mass on the arg-max of l among the allowed
        tokens, the first under ties (`sampling.greedy_among`), with normalizer log 1 = 0. That
        is the limit T -> 0 of the shaped law at T > 0: with r = softmax(l / T) and m the largest
        allowed l, g_T(y) = exp(alpha (l(y) - m) / T) mask(y) / sum_y' exp(alpha (l(y') - m) / T)
        mask(y'), whose every allowed term below m vanishes (alpha > 0) while those at m stay 1.
        So it is the same for any alpha, and never empty while the mask allows a token. Masking
        the T = 0 law instead (all mass on the unconstrained arg-max) empties it whenever that
        token is not allowed. Truncation is moot at T = 0, as in `sampling.log_probs`; at T > 0
        a top-k, top-p or min-p that keeps none of the allowed tokens is the user's own cut, and
        stays a dead end (`SETTINGS_DEAD_END`)."""
        if masks is None:
            masks = self.masks(particles, logr.shape[-1])
        if greedy:
            z = sampling.greedy_among(logr, masks)
        else:
            z = logr.clone()
            if self.alpha != 1.0:  # log 0 stays -inf (an alpha that underflows to 0 gives NaN)
                z = torch.where(torch.isneginf(logr), logr, logr * self.alpha)
            if masks is not None:
                z.masked_fill_(~masks, NEG_INF)
        norm = torch.logsumexp(z.double(), dim=-1)  # [B]
        dead = torch.isneginf(norm)
        for row in dead.nonzero().flatten().tolist():
            self._dead_end(particles[row])
        logg = torch.where(dead[:, None], z, z - norm.float().masked_fill(dead, 0.0)[:, None])
        return logg, norm

    def masks(self, particles: list[int], vocab: int) -> torch.Tensor | None:
        """[B, V] bool: the tokens each particle's state allows; None when the potential masks
        nothing."""
        if not self.potential.has_mask:
            return None
        everything = torch.ones(vocab, dtype=torch.bool)
        rows = [self.potential.allowed(self.states[i]) for i in particles]
        if not rows:
            return torch.ones(0, vocab, dtype=torch.bool)
        return torch.stack([everything if m is None else m for m in rows])

    def _dead_end(self, i: int) -> None:
        """Record, once per particle, why its shaped law is empty: the potential's own reason
        (a matcher that gave up), or the sampling settings when the mask allows some token."""
        if self.died[i]:
            return
        self.died[i] = True
        state = self.states[i]
        reason = self.potential.error(state)
        if reason is None:
            mask = self.potential.allowed(state)
            nothing = mask is not None and not bool(mask.any())
            reason = "the constraint allows no next token" if nothing else SETTINGS_DEAD_END
        self.note(reason)

    def note(self, reason: str) -> None:
        if reason not in self.errors:
            self.errors.append(reason)

    def dead_end(self) -> ConstraintError:
        """The error of a decode all of whose sequences ended in a dead end, naming why."""
        why = "; ".join(self.errors[:3]) or "every sequence reached a dead end"
        return ConstraintError("no output can satisfy the constraints: " + why.replace("\n", " "))

    def advance(self, particles: list[int], tokens: torch.Tensor, active: torch.Tensor) -> None:
        for row, i in enumerate(particles):
            if active[row]:
                self.states[i] = self.potential.advance(self.states[i], int(tokens[row]))

    def value_change(self, i: int, tokens: list[int], final: bool) -> float:
        """v(tokens) - v(previous) for particle i; -inf (and a recorded error) if v raises."""
        if not self.potential.has_value:
            return 0.0
        try:
            new = self.potential.log_value(tokens, final)
        except Exception as err:  # a user's reward: one failing particle must not stop the rest
            self.note(f"{type(err).__name__}: {err}")
            return NEG_INF
        change = new - float(self.value[i])
        self.value[i] = new
        return change

    def end(self, i: int) -> float:
        """log_end of a particle cut at max_new_tokens (incomplete under a constraint: -inf)."""
        return self.potential.log_end(self.states[i])

    def release(self) -> None:
        """Drop the particles' states (a matcher each under a constraint, megabytes for a big
        grammar) as the decode ends, not when the last reference to the decode's frames goes
        (a failed job's error keeps them), and hand the freed heap back to the system."""
        self.states = []
        release_heap()

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Resampling: particle j becomes a copy of particle ancestors[j]."""
        self.states = [self.potential.copy(self.states[int(a)]) for a in ancestors]
        self.value = self.value[ancestors]
        self.died = self.died[ancestors]
