"""SMC speculative decoding (Emara et al. 2026).

N particles. Each round, for every live particle i:
    x_{1..K} ~ q                       (draft, K sequential batched steps)
    p(x_1..x_K), p(. | x_1..x_K)       (target, ONE batched pass over N x (K+1) positions)
    b ~ p(. | x_1..x_K)                (bonus token, exact, no weight)
    log_w_i += sum_k [log p(x_k) - log q(x_k)]
so every round commits exactly K+1 tokens per particle. When ESS = 1 / sum W_i^2 < threshold * N,
ancestors are resampled, log Z-hat += log mean_i w_i, and weights reset to uniform. A particle
that emits EOS is finished: absorbing, zero increment from then on, and it leaves the batch so it
costs no more forward passes. At the end one particle is drawn with probability W_i.

If every particle's weight becomes zero in a round (a draft token outside the target's support,
e.g. under top-k), the round is replaced by one exact target step; `collapses` counts this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import particles
from smcspec.decoding.base import (
    DecodeResult,
    SMCStats,
    StageClock,
    Watch,
    check_prompt,
    pending,
    released,
    rollback,
    start_cache,
)
from smcspec.decoding.guide import Guide
from smcspec.models.base import CausalLM, KVCache
from smcspec.potentials import Potential


@dataclass
class Population:
    """All N particles. tokens [N, max_new] holds generated ids; row i is valid up to lengths[i].
    Live (unfinished) particles all have `generated` tokens; cache row r is the r-th live one."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor
    log_w: torch.Tensor
    generated: int = 0
    log_z: float = 0.0
    ess_history: list[float] = field(default_factory=list)
    resamples: int = 0
    collapses: int = 0

    @classmethod
    def start(cls, n: int, max_new: int) -> Population:
        return cls(
            tokens=torch.zeros(n, max_new, dtype=torch.long),
            lengths=torch.zeros(n, dtype=torch.long),
            finished=torch.zeros(n, dtype=torch.bool),
            log_w=torch.zeros(n, dtype=torch.float64),
        )

    @property
    def live(self) -> torch.Tensor:
        return torch.nonzero(~self.finished).squeeze(1)

    def common_prefix(self) -> list[int]:
        """The tokens every particle shares, finished ones included: whichever particle is drawn
        at the end starts with them, and resampling only narrows the set, so they only grow."""
        shortest = int(self.lengths.min())
        same = (self.tokens[:, :shortest] == self.tokens[:1, :shortest]).all(dim=0)  # [shortest]
        differ = torch.nonzero(~same)
        agreed = int(differ[0]) if differ.numel() else shortest
        return self.tokens[0, :agreed].tolist()

    def live_sequences(self, prompt: torch.Tensor) -> torch.Tensor:
        """Prompt + generated tokens of each live particle: [B, L + generated]."""
        live = self.live
        head = prompt[None].expand(live.numel(), -1)
        return torch.cat([head, self.tokens[live, : self.generated]], dim=1)

    def collapses_with(self, increment: torch.Tensor) -> bool:
        """Whether adding the live particles' log-weight terms [B] leaves every weight zero."""
        log_w = self.log_w.clone()
        log_w[self.live] += increment.double()
        return bool(torch.isneginf(log_w).all())

    def reweight(self, increment: torch.Tensor) -> None:
        """log w_i += the round's terms [B] of each live particle i (before `extend`, which may
        finish some)."""
        self.log_w[self.live] += increment.double()

    def extend(self, block: torch.Tensor, kept: torch.Tensor, ended: torch.Tensor) -> None:
        """Append block [B, k + 1] to the live particles: row b keeps its first kept[b] tokens
        and is finished where ended[b] (it emitted EOS)."""
        live, g = self.live, self.generated
        self.tokens[live, g : g + block.shape[1]] = block
        self.lengths[live] = g + kept
        self.finished[live] = ended
        self.generated = g + block.shape[1]

    def resample(self, ancestors: torch.Tensor) -> None:
        """Particle i becomes a copy of particle ancestors[i] [N]; log Z-hat takes the mean
        weight, and the weights reset to uniform."""
        self.log_z += particles.log_mean_weight(self.log_w)
        self.tokens = self.tokens[ancestors]
        self.lengths = self.lengths[ancestors]
        self.finished = self.finished[ancestors]
        self.log_w = torch.zeros_like(self.log_w)
        self.resamples += 1

    def finish(self) -> torch.Tensor:
        """Close log Z-hat with the last weights' mean; the normalized weights W [N] (all zero
        when every particle died)."""
        self.log_z += particles.log_mean_weight(self.log_w)
        if torch.isneginf(self.log_w).all():
            return torch.zeros_like(self.log_w)
        return particles.normalize(self.log_w)


def weigh(
    block: torch.Tensor, log_ratio: torch.Tensor, eos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens of block [B, k + 1] that count (up to and including the first EOS), as
    (log-weight increment: the sum of their terms log_ratio [B, k + 1]; how many [B]; whether
    the row ended [B])."""
    b, width = block.shape
    is_eos = torch.isin(block, eos)
    ended = is_eos.any(dim=1)
    first_eos = torch.where(ended, is_eos.float().argmax(dim=1), torch.full((b,), width - 1))
    counted = torch.arange(width)[None, :] <= first_eos[:, None]  # [B, k + 1]
    zero = torch.zeros((), dtype=log_ratio.dtype)
    return torch.where(counted, log_ratio, zero).sum(dim=1), first_eos + 1, ended


class SMCDecoder:
    """SMC-SD towards p, or towards p(x) phi(x) / Z with a potential phi (see `guide`)."""

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM,
        config: SMCConfig,
        potential: Potential | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.potential = potential

    def decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None = None,
    ) -> DecodeResult:
        check_prompt(prompt, self.target)
        n = self.config.particles
        guide = Guide(self.potential, n) if self.potential is not None else None
        try:
            return self._decode(prompt, sampling_cfg, generator, watch, guide)
        finally:
            if guide is not None:  # even if the job's error (and its frames) is kept
                guide.release()

    def _decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None,
        guide: Guide | None,
    ) -> DecodeResult:
        clock = StageClock()
        n = self.config.particles
        prompt_t = torch.tensor(prompt, dtype=torch.long)
        pop = Population.start(n, sampling_cfg.max_new_tokens)
        with released() as held:
            with clock.stage("prefill"):
                caches = (
                    start_cache(self.target, prompt_t, n, held),
                    start_cache(self.draft, prompt_t, n, held),
                )
            rounds = 0
            stopped = False
            while pop.live.numel() > 0 and pop.generated < sampling_cfg.max_new_tokens:
                self._round(pop, prompt_t, caches, sampling_cfg, generator, clock, guide)
                rounds += 1
                if guide is not None and torch.isneginf(pop.log_w).all():
                    break  # every particle died: nothing left to extend
                if watch is not None and watch(pop.common_prefix()):
                    stopped = True
                    break
        if guide is not None:
            self._finish_potential(pop, guide)
        weights = pop.finish()
        choice = self._draw_answer(weights, generator)
        seconds, split = clock.finish()
        all_tokens = [pop.tokens[i, : pop.lengths[i]].tolist() for i in range(n)]
        stats = SMCStats(
            stopped=stopped,
            ess=pop.ess_history,
            resamples=pop.resamples,
            collapses=pop.collapses,
            weights=weights.tolist(),
            log_z_hat=pop.log_z,
            chosen_particle=choice,
        )
        if guide is not None:
            stats.valid_particles = int((~torch.isneginf(pop.log_w)).sum())
            stats.potential_errors = guide.errors[:10]
        return DecodeResult(all_tokens[choice], rounds, seconds, split, stats, all_tokens)

    def _draw_answer(self, weights: torch.Tensor, generator: torch.Generator) -> int:
        """The returned particle: i with probability W_i [N], so that the output's law is the
        expectation of the weighted particle measure sum_i W_i delta(x_i). All-zero weights
        (every particle died) draw uniformly."""
        if not bool(weights.sum() > 0):
            weights = torch.ones_like(weights)
        return int(torch.multinomial(weights, 1, generator=generator))

    def _round(
        self,
        pop: Population,
        prompt: torch.Tensor,
        caches: tuple[KVCache, KVCache],
        s: SamplingConfig,
        generator: torch.Generator,
        clock: StageClock,
        guide: Guide | None = None,
    ) -> None:
        t_cache, d_cache = caches
        k = min(self.config.draft_tokens, s.max_new_tokens - pop.generated - 1)
        seqs = pop.live_sequences(prompt)  # [B, L + G]
        ids = pop.live.tolist()
        with clock.stage("draft"):
            # [B, k], [B, k], [B]
            drafts, logq_x, dead = self._propose(seqs, d_cache, k, s, generator, guide, ids)
        with clock.stage("verify"):
            feed = torch.cat([pending(seqs, t_cache).to(drafts.device), drafts], dim=1)
            logits = self.target.forward(feed, t_cache, k + 1)  # [B, k + 1, V]
            if guide is not None:  # potentials live on the host
                logits = logits.cpu()
            logp = sampling.log_probs(logits, s.temperature, s.top_k, s.top_p)
            # no-ops but for k = 0, whose empty drafts never met the device
            drafts, logq_x = drafts.to(logp.device), logq_x.to(logp.device)
            logp_x = sampling.pick(logp[:, :k], drafts)  # [B, k]
            if guide is None:
                bonus = sampling.sample(logp[:, k], generator)  # [B], exact: no weight
                log_ratio = torch.cat([logp_x - logq_x, torch.zeros_like(logp_x[:, :1])], 1)
            else:
                bonus, log_ratio = self._guided_bonus(
                    guide, ids, logp, logp_x, logq_x, dead, s, generator
                )
            # The round's one host sync: the bookkeeping below runs on the host.
            drafts, bonus, log_ratio = drafts.cpu(), bonus.cpu(), log_ratio.cpu()
        rows_before = pop.live
        block = torch.cat([drafts, bonus[:, None]], dim=1)  # [B, k + 1]
        increment, kept, ended = self._weigh(block, log_ratio, s)  # [B] each
        if guide is None and pop.collapses_with(increment):
            self._exact_step(pop, logp[:, 0], s, generator)
            for cache in caches:
                rollback(cache, prompt.numel() + pop.generated)
        else:
            pop.reweight(increment)
            pop.extend(block, kept, ended)
            if guide is not None:
                self._advance_potential(pop, guide, ids, drafts, bonus, s)
        with clock.stage("resample"):
            self._maybe_resample(pop, rows_before, caches, generator, guide)

    def _propose(
        self,
        seqs: torch.Tensor,
        cache: KVCache,
        k: int,
        s: SamplingConfig,
        generator: torch.Generator,
        guide: Guide | None = None,
        ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft tokens [B, k], their log proposal probability [B, k], K batched draft steps, and
        which rows hit a dead end [B]. With a guide the proposal is the shaped law
        g = q^alpha mask / norm, and the guide's states follow the drafts up to an EOS."""
        b = seqs.shape[0]
        tokens: list[torch.Tensor] = []  # each [B], on the draft's device
        logq_x: list[torch.Tensor] = []
        dead = torch.zeros(b, dtype=torch.bool)
        ended = torch.zeros(b, dtype=torch.bool)
        eos = self._eos(s)
        feed = pending(seqs, cache)
        for _ in range(k):
            logits = self.draft.forward(feed, cache, 1)[:, -1]  # [B, V]
            if guide is not None:  # potentials live on the host
                logits = logits.cpu()
            logq = sampling.log_probs(logits, s.proposal_temperature, s.top_k, s.top_p)
            if guide is not None:
                logg, norm = guide.shaped(ids, logq)
                dead |= torch.isneginf(norm) & ~ended
                logq = torch.where((ended | dead)[:, None], logq, logg)
            x = sampling.sample(logq, generator)  # [B], stays on the device: no sync
            tokens.append(x)
            logq_x.append(sampling.pick(logq, x))
            if guide is not None:
                is_eos = torch.isin(x, eos)
                guide.advance(ids, x, ~ended & ~dead & ~is_eos)
                ended |= is_eos
            feed = x[:, None]
        if k == 0:  # no draft step: the empty drafts stay on the host
            return torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0), dead
        return torch.stack(tokens, dim=1), torch.stack(logq_x, dim=1), dead

    def _guided_bonus(
        self,
        guide: Guide,
        ids: list[int],
        logp: torch.Tensor,
        logp_x: torch.Tensor,
        logq_x: torch.Tensor,
        dead: torch.Tensor,
        s: SamplingConfig,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bonus tokens [B] from the shaped target law at the last position, and the log weight
        terms [B, k + 1]: alpha log p(x_k) - log g(x_k) per draft, the local normalizer for the
        bonus; a dead row gets -inf."""
        k = logp_x.shape[1]
        logg, norm = guide.shaped(ids, logp[:, k])  # states are past the drafts
        dead = dead | torch.isneginf(norm)
        bonus = sampling.sample(torch.where(dead[:, None], logp[:, k], logg), generator)
        log_ratio = torch.cat([guide.alpha * logp_x - logq_x, norm.float()[:, None]], dim=1)
        return bonus, log_ratio.masked_fill(dead[:, None], float("-inf"))

    def _advance_potential(
        self,
        pop: Population,
        guide: Guide,
        ids: list[int],
        drafts: torch.Tensor,
        bonus: torch.Tensor,
        s: SamplingConfig,
    ) -> None:
        """Move the states past the bonus token and add each unfinished particle's change of
        the sequence factor."""
        eos = self._eos(s)
        no_eos_before = ~torch.isin(drafts, eos).any(dim=1)
        guide.advance(ids, bonus, no_eos_before & ~torch.isin(bonus, eos))
        if guide.potential.has_value:
            for i in ids:
                if not pop.finished[i] and not torch.isneginf(pop.log_w[i]):
                    pop.log_w[i] += guide.value_change(
                        i, pop.tokens[i, : pop.lengths[i]].tolist(), False
                    )

    def _finish_potential(self, pop: Population, guide: Guide) -> None:
        """The sequence factor's final value, and log_end for particles cut at the length
        limit (a constraint kills those left incomplete)."""
        for i in range(pop.log_w.numel()):
            if torch.isneginf(pop.log_w[i]):
                continue
            tokens = pop.tokens[i, : pop.lengths[i]].tolist()
            pop.log_w[i] += guide.value_change(i, tokens, True)
            if not pop.finished[i]:
                pop.log_w[i] += guide.end(i)

    def _eos(self, s: SamplingConfig) -> torch.Tensor:
        ids = sorted(self.target.eos_token_ids) if s.stop_at_eos else []
        return torch.tensor(ids, dtype=torch.long)

    def _weigh(
        self, block: torch.Tensor, log_ratio: torch.Tensor, s: SamplingConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`weigh` under this request's EOS set."""
        return weigh(block, log_ratio, self._eos(s))

    def _exact_step(
        self,
        pop: Population,
        logp_first: torch.Tensor,
        s: SamplingConfig,
        generator: torch.Generator,
    ) -> None:
        """The round would leave every weight zero: instead of it, each live particle gets one
        token drawn exactly from p (logp_first [B, V]), at no weight."""
        pop.collapses += 1
        token = sampling.sample(logp_first, generator).cpu()  # [B]
        pop.extend(token[:, None], torch.ones_like(token), torch.isin(token, self._eos(s)))

    def _maybe_resample(
        self,
        pop: Population,
        rows_before: torch.Tensor,
        caches: tuple[KVCache, KVCache],
        generator: torch.Generator,
        guide: Guide | None = None,
    ) -> None:
        """Resample if ESS < threshold * N, then make the cache rows match the live particles.

        rows_before [B] are the particles the cache rows held at the start of the round.
        """
        n = pop.log_w.numel()
        ess = particles.ess(pop.log_w)
        pop.ess_history.append(ess)
        ancestors = torch.arange(n)
        if ess < self.config.resample_threshold * n:
            ancestors = particles.resample(pop.log_w, self.config.resampling, generator)
            pop.resample(ancestors)
            if guide is not None:
                guide.reorder(ancestors)
        row_of = torch.full((n,), -1, dtype=torch.long)
        row_of[rows_before] = torch.arange(rows_before.numel())
        rows = row_of[ancestors[~pop.finished]]
        assert (rows >= 0).all(), "a live particle must descend from a cached row"
        if rows.numel() != rows_before.numel() or not torch.equal(rows, torch.arange(rows.numel())):
            for cache in caches:
                cache.select(rows)
