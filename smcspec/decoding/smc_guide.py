"""What an SMC round does differently with a potential, behind one interface.

`SMCDecoder` picks its guide once per decode and then runs the same round either way:
- `NoGuide`: pi = p. Drafts come from q, the bonus token is an exact draw from p at no weight,
  and each draft is weighted by log p(x) - log q(x).
- `PotentialGuide`: pi = p^alpha * mask * exp(v) / Z (see `guide.py`). Drafts come from the
  shaped law g, the bonus from the shaped target law with its local normalizer as weight, the
  sequence factor v enters after every round, and a particle that hits a dead end dies alone.
  At target temperature 0 every step's target law is the point mass on the likeliest allowed
  token, so a particle lives only while its drafts are those tokens: each draft weighs 0 or
  -inf, the bonus 0, and the survivors are one sequence with equal weights (a greedy proposal
  makes all N the same). A round that no particle survives is replaced by one exact step, as
  without a potential.

Each method of `NoGuide` is the identity (or nothing), so the no-potential path runs exactly the
operations it would without any guide: outputs are bit-identical and it costs nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig
from smcspec.decoding.base import SMCStats
from smcspec.decoding.guide import Guide
from smcspec.decoding.population import Population
from smcspec.potentials import Potential


class RoundGuide(Protocol):
    """The hooks of one SMC decode. Rows are the round's live particles, ids their indices."""

    on_host: bool  # the logits must move to the host (potentials run there)

    def begin(self, ids: list[int]) -> None: ...
    def proposal(self, logq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...
    def drafted(self, x: torch.Tensor) -> None: ...
    def target(self, logp: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...
    def bonus(
        self, logp: torch.Tensor, logp_x: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def collapses(self, pop: Population, increment: torch.Tensor) -> bool: ...
    def exact(self, pop: Population, law: torch.Tensor, token: torch.Tensor) -> None: ...
    def committed(self, pop: Population, bonus: torch.Tensor) -> None: ...
    def reorder(self, ancestors: torch.Tensor) -> None: ...
    def finish(self, pop: Population) -> None: ...
    def report(self, stats: SMCStats, pop: Population) -> None: ...
    def release(self) -> None: ...


class NoGuide:
    """pi = p: the plain SMC-SD round."""

    on_host = False

    def begin(self, ids: list[int]) -> None:
        pass

    def proposal(self, logq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return logq

    def drafted(self, x: torch.Tensor) -> None:
        pass

    def target(self, logp: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return logp

    def bonus(
        self, logp: torch.Tensor, logp_x: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bonus tokens [B] drawn exactly from p(. | drafts) (logp [B, k + 1, V]); the target's
        log-density at the drafts, log p(x_j) [B, k]; the bonus's weight term [B], 0 (exact)."""
        k = logp_x.shape[1]
        bonus = sampling.sample(logp[:, k], generator)  # [B], exact: no weight
        return bonus, logp_x, logp_x.new_zeros(logp_x.shape[0])

    def collapses(self, pop: Population, increment: torch.Tensor) -> bool:
        """Whether the round's terms [B] leave every weight zero: the round is then replaced by
        one exact step (a draft outside p's support, e.g. under top-k)."""
        return pop.collapses_with(increment)

    def exact(self, pop: Population, law: torch.Tensor, token: torch.Tensor) -> None:
        pass

    def committed(self, pop: Population, bonus: torch.Tensor) -> None:
        pass

    def reorder(self, ancestors: torch.Tensor) -> None:
        pass

    def finish(self, pop: Population) -> None:
        pass

    def report(self, stats: SMCStats, pop: Population) -> None:
        pass

    def release(self) -> None:
        pass


class PotentialGuide:
    """pi = p^alpha * mask * exp(v) / Z: proposals and bonus tokens from shaped laws, one state
    per particle (`Guide`), and per-particle deaths instead of a round's collapse (but at
    target temperature 0, where only the greedy sequence has weight)."""

    on_host = True

    def __init__(self, potential: Potential, n: int, eos: torch.Tensor, s: SamplingConfig) -> None:
        self.guide = Guide(potential, n)
        self.eos = eos
        self.greedy = s.temperature == 0  # the target's laws are point masses
        self.greedy_proposal = s.proposal_temperature == 0
        self.ids: list[int] = []
        self.dead = torch.zeros(0, dtype=torch.bool)  # [B] the mask allowed nothing
        self.ended = torch.zeros(0, dtype=torch.bool)  # [B] a draft was EOS
        # Greedy target only: the masks [B, V] at each of the round's positions (draft step j
        # and target position j continue the same prefix), and the states the round began
        # from, which a collapsed round goes back to (a matcher moves in place).
        self.masks: list[torch.Tensor | None] = []
        self.start: tuple[list[Any], torch.Tensor] = ([], torch.zeros(0, dtype=torch.bool))

    def begin(self, ids: list[int]) -> None:
        self.ids = ids
        self.dead = torch.zeros(len(ids), dtype=torch.bool)
        self.ended = torch.zeros(len(ids), dtype=torch.bool)
        if self.greedy:
            g = self.guide
            self.masks = []
            self.start = ([g.potential.copy(g.states[i]) for i in ids], g.died[ids].clone())

    def proposal(self, logq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The shaped law g = q^alpha mask / norm [B, V] for rows still drafting (at proposal
        temperature 0 the point mass on the draft's likeliest allowed token, from its scores
        [B, V]); q itself for rows past an EOS or a dead end (their tokens do not count)."""
        masks = self.guide.masks(self.ids, logq.shape[-1])
        if self.greedy:
            self.masks.append(masks)
        r = scores if self.greedy_proposal else logq
        logg, norm = self.guide.shaped(self.ids, r, self.greedy_proposal, masks)
        self.dead |= torch.isneginf(norm) & ~self.ended
        return torch.where((self.ended | self.dead)[:, None], logq, logg)

    def drafted(self, x: torch.Tensor) -> None:
        """The states follow the drafts x [B] up to an EOS."""
        is_eos = torch.isin(x, self.eos)
        self.guide.advance(self.ids, x, ~self.ended & ~self.dead & ~is_eos)
        self.ended |= is_eos

    def target(self, logp: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The target's laws at the round's k + 1 positions [B, k + 1, V] that the weights and
        the bonus use: logp itself, or at temperature 0 the point mass on the likeliest allowed
        token of the scores [B, k + 1, V] at each position (`Guide.shaped`, greedy); there p is
        the point mass on the unconstrained arg-max, which the mask would empty."""
        if not self.greedy:
            return logp
        self.masks.append(self.guide.masks(self.ids, scores.shape[-1]))  # past the drafts
        laws = [
            self.guide.shaped(self.ids, scores[:, j], True, masks)[0]
            for j, masks in enumerate(self.masks)
        ]
        return torch.stack(laws, dim=1)

    def bonus(
        self, logp: torch.Tensor, logp_x: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bonus tokens [B] from the shaped target law at the last position; the target's
        log-density at the drafts, alpha log p(x_j) [B, k]; the bonus's weight term [B], the
        local normalizer; a dead row gets -inf in both. logp [B, k + 1, V]: `target`'s laws."""
        k = logp_x.shape[1]
        masks = self.masks[k] if self.greedy else None  # `target` has them
        logg, norm = self.guide.shaped(self.ids, logp[:, k], masks=masks)  # past the drafts
        dead = self.dead | torch.isneginf(norm)
        bonus = sampling.sample(torch.where(dead[:, None], logp[:, k], logg), generator)
        log_target = (self.guide.alpha * logp_x).masked_fill(dead[:, None], float("-inf"))
        return bonus, log_target, norm.float().masked_fill(dead, float("-inf"))

    def collapses(self, pop: Population, increment: torch.Tensor) -> bool:
        """Only at temperature 0, where a particle dies for a draft that is not the target's
        token, not only at a dead end: whether the round's terms [B] leave every weight zero
        (the exact step then finds the dead ends). Otherwise a dead particle dies alone; the
        decode stops when all have died."""
        return self.greedy and pop.collapses_with(increment)

    def exact(self, pop: Population, law: torch.Tensor, token: torch.Tensor) -> None:
        """A collapsed round's exact step, token [B] drawn from `target`'s law at its first
        position [B, V]: the states go back to the round's start (to follow the token in
        `committed`), and a row whose law there was empty, a dead end, gets weight zero."""
        pop.reweight(sampling.pick(law, token))  # 0, or -inf for a dead end
        states, died = self.start
        for row, i in enumerate(self.ids):
            self.guide.states[i] = states[row]
        self.guide.died[self.ids] = died
        self.dead = torch.zeros(len(self.ids), dtype=torch.bool)
        self.ended = torch.zeros(len(self.ids), dtype=torch.bool)

    def committed(self, pop: Population, bonus: torch.Tensor) -> None:
        """Move the states past the bonus tokens [B] (unless an EOS came first), and add each
        unfinished living particle's change of the sequence factor v."""
        self.guide.advance(self.ids, bonus, ~self.ended & ~torch.isin(bonus, self.eos))
        if not self.guide.potential.has_value:
            return
        for i in self.ids:
            if not pop.finished[i] and not torch.isneginf(pop.log_w[i]):
                pop.log_w[i] += self.guide.value_change(i, pop.sequence(i), False)

    def reorder(self, ancestors: torch.Tensor) -> None:
        self.guide.reorder(ancestors)

    def finish(self, pop: Population) -> None:
        """The sequence factor's final value, and log_end for particles cut at the length limit
        (a constraint kills those left incomplete). If no particle is left, and none was merely
        cut, every one reached a dead end: `ConstraintError`."""
        cut = pop.cut()
        for i in range(pop.log_w.numel()):
            if torch.isneginf(pop.log_w[i]):
                continue
            pop.log_w[i] += self.guide.value_change(i, pop.sequence(i), True)
            if not pop.finished[i]:
                pop.log_w[i] += self.guide.end(i)
        if torch.isneginf(pop.log_w).all() and not cut.any():
            raise self.guide.dead_end()

    def report(self, stats: SMCStats, pop: Population) -> None:
        stats.valid_particles = int((~torch.isneginf(pop.log_w)).sum())
        stats.potential_errors = self.guide.errors[:10]

    def release(self) -> None:
        self.guide.release()
