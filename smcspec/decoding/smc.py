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
    StageClock,
    check_prompt,
    pending,
    released,
    rollback,
    start_cache,
)
from smcspec.models.base import CausalLM, KVCache


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

    def live_sequences(self, prompt: torch.Tensor) -> torch.Tensor:
        """Prompt + generated tokens of each live particle: [B, L + generated]."""
        live = self.live
        head = prompt[None].expand(live.numel(), -1)
        return torch.cat([head, self.tokens[live, : self.generated]], dim=1)


class SMCDecoder:
    def __init__(self, target: CausalLM, draft: CausalLM, config: SMCConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config

    def decode(
        self, prompt: list[int], sampling_cfg: SamplingConfig, generator: torch.Generator
    ) -> DecodeResult:
        check_prompt(prompt, self.target)
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
            while pop.live.numel() > 0 and pop.generated < sampling_cfg.max_new_tokens:
                self._round(pop, prompt_t, caches, sampling_cfg, generator, clock)
                rounds += 1
        pop.log_z += particles.log_mean_weight(pop.log_w)
        weights = particles.normalize(pop.log_w)
        choice = int(torch.multinomial(weights, 1, generator=generator))
        seconds, split = clock.finish()
        all_tokens = [pop.tokens[i, : pop.lengths[i]].tolist() for i in range(n)]
        stats = {
            "ess": pop.ess_history,
            "resamples": pop.resamples,
            "collapses": pop.collapses,
            "weights": weights.tolist(),
            "log_z_hat": pop.log_z,
            "chosen_particle": choice,
        }
        return DecodeResult(all_tokens[choice], rounds, seconds, split, stats, all_tokens)

    def _round(
        self,
        pop: Population,
        prompt: torch.Tensor,
        caches: tuple[KVCache, KVCache],
        s: SamplingConfig,
        generator: torch.Generator,
        clock: StageClock,
    ) -> None:
        t_cache, d_cache = caches
        k = min(self.config.draft_tokens, s.max_new_tokens - pop.generated - 1)
        seqs = pop.live_sequences(prompt)  # [B, L + G]
        with clock.stage("draft"):
            drafts, logq_x = self._propose(seqs, d_cache, k, s, generator)  # [B, k], [B, k]
        with clock.stage("verify"):
            feed = torch.cat([pending(seqs, t_cache), drafts], dim=1)
            logits = self.target.forward(feed, t_cache, k + 1)  # [B, k + 1, V]
            logp = sampling.log_probs(logits, s.temperature, s.top_k, s.top_p)
            bonus = sampling.sample(logp[:, k], generator)  # [B]
            logp_x = sampling.pick(logp[:, :k], drafts)  # [B, k]
        log_w_before, g0 = pop.log_w.clone(), pop.generated
        rows_before = pop.live
        self._commit(pop, drafts, bonus, logp_x - logq_x, s)
        if torch.isneginf(pop.log_w).all():
            self._exact_step(pop, rows_before, log_w_before, g0, logp[:, 0], s, generator)
            for cache in caches:
                rollback(cache, prompt.numel() + pop.generated)
        with clock.stage("resample"):
            self._maybe_resample(pop, rows_before, caches, generator)

    def _propose(
        self,
        seqs: torch.Tensor,
        cache: KVCache,
        k: int,
        s: SamplingConfig,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [B, k] and their log q [B, k], K batched draft steps."""
        b = seqs.shape[0]
        tokens = torch.zeros(b, k, dtype=torch.long)
        logq_x = torch.zeros(b, k, dtype=torch.float32)
        feed = pending(seqs, cache)
        for i in range(k):
            logits = self.draft.forward(feed, cache, 1)[:, -1]  # [B, V]
            logq = sampling.log_probs(logits, s.proposal_temperature, s.top_k, s.top_p)
            x = sampling.sample(logq, generator)
            tokens[:, i] = x
            logq_x[:, i] = sampling.pick(logq, x)
            feed = x[:, None]
        return tokens, logq_x

    def _commit(
        self,
        pop: Population,
        drafts: torch.Tensor,
        bonus: torch.Tensor,
        log_ratio: torch.Tensor,
        s: SamplingConfig,
    ) -> None:
        """Append drafts [B, k] + bonus [B] to the live particles; weight by log p - log q [B, k]
        over the tokens up to and including the first EOS."""
        live = pop.live
        b, k = drafts.shape
        block = torch.cat([drafts, bonus[:, None]], dim=1)  # [B, k + 1]
        if s.stop_at_eos:
            is_eos = torch.isin(block, torch.tensor(sorted(self.target.eos_token_ids)))
        else:
            is_eos = torch.zeros_like(block, dtype=torch.bool)
        has_eos = is_eos.any(dim=1)
        first_eos = torch.where(has_eos, is_eos.float().argmax(dim=1), torch.full((b,), k))
        counted = torch.arange(k)[None, :] <= first_eos[:, None]  # [B, k]
        zero = torch.zeros((), dtype=log_ratio.dtype)
        increment = torch.where(counted, log_ratio, zero).sum(dim=1)
        g = pop.generated
        pop.tokens[live, g : g + k + 1] = block
        pop.lengths[live] = g + first_eos + 1
        pop.finished[live] = has_eos
        pop.log_w[live] += increment.double()
        pop.generated = g + k + 1

    def _exact_step(
        self,
        pop: Population,
        live: torch.Tensor,
        log_w_before: torch.Tensor,
        g0: int,
        logp_first: torch.Tensor,
        s: SamplingConfig,
        generator: torch.Generator,
    ) -> None:
        """Every weight hit zero: undo the round and give each live particle (rows `live`, which
        had g0 tokens) one token drawn exactly from p, at no weight."""
        pop.collapses += 1
        pop.log_w = log_w_before
        token = sampling.sample(logp_first, generator)  # [B]
        pop.tokens[live, g0] = token
        pop.lengths[live] = g0 + 1
        eos = torch.tensor(sorted(self.target.eos_token_ids))
        pop.finished[live] = torch.isin(token, eos) if s.stop_at_eos else False
        pop.generated = g0 + 1

    def _maybe_resample(
        self,
        pop: Population,
        rows_before: torch.Tensor,
        caches: tuple[KVCache, KVCache],
        generator: torch.Generator,
    ) -> None:
        """Resample if ESS < threshold * N, then make the cache rows match the live particles.

        rows_before [B] are the particles the cache rows held at the start of the round.
        """
        n = pop.log_w.numel()
        ess = particles.ess(pop.log_w)
        pop.ess_history.append(ess)
        source = torch.arange(n)
        if ess < self.config.resample_threshold * n:
            pop.log_z += particles.log_mean_weight(pop.log_w)
            source = particles.resample(pop.log_w, self.config.resampling, generator)
            pop.tokens = pop.tokens[source]
            pop.lengths = pop.lengths[source]
            pop.finished = pop.finished[source]
            pop.log_w = torch.zeros(n, dtype=torch.float64)
            pop.resamples += 1
        row_of = torch.full((n,), -1, dtype=torch.long)
        row_of[rows_before] = torch.arange(rows_before.numel())
        rows = row_of[source[~pop.finished]]
        assert (rows >= 0).all(), "a live particle must descend from a cached row"
        if rows.numel() != rows_before.numel() or not torch.equal(rows, torch.arange(rows.numel())):
            for cache in caches:
                cache.select(rows)
