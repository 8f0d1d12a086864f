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
e.g. under top-k, or at temperature 0 a draft other than the target's arg-max, allowed or not
under a constraint), the round is replaced by one exact target step; `collapses` counts this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import particles
from smcspec.decoding.agreement import agreement
from smcspec.decoding.base import (
    Call,
    Decoder,
    DecodeResult,
    SMCStats,
    StageClock,
    check_prompt,
    opened,
    pending,
    rollback,
)
from smcspec.decoding.logprobs import score
from smcspec.decoding.population import Population
from smcspec.decoding.smc_guide import NoGuide, PotentialGuide, RoundGuide
from smcspec.models.base import CausalLM, KVCache
from smcspec.potentials import Potential


@dataclass(frozen=True)
class _Run:
    """What every round of one decode reads: the particles' shared start [L] (the prompt, whose
    first `prompt_len` tokens penalties leave out, then the tokens generated before the decode),
    the target's and the draft's caches, the request's sampling settings, its generator, the
    stage clock and the round guide (potentials, or none)."""

    start: torch.Tensor
    prompt_len: int
    caches: tuple[KVCache, KVCache]
    s: SamplingConfig
    generator: torch.Generator
    clock: StageClock
    guide: RoundGuide


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


def _score(
    logp: torch.Tensor, drafts: torch.Tensor, bonus: torch.Tensor, top: int | None
) -> tuple[torch.Tensor, ...] | None:
    """`logprobs.score` of a round's block (drafts [B, k], then bonus [B]) under the target's
    law at its positions (logp [B, k + 1, V]); None when no logprobs are asked for."""
    if top is None:
        return None
    return score(logp, torch.cat([drafts, bonus[:, None]], dim=1), top)


class SMCDecoder(Decoder):
    """SMC-SD towards p, or towards p(x) phi(x) / Z with a potential phi (see `smc_guide`)."""

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

    def _decode(self, call: Call) -> DecodeResult:
        return self.resume(call)

    def resume(
        self,
        call: Call,
        generated: Sequence[int] = (),
        stop_when: Callable[[Population], bool] | None = None,
    ) -> DecodeResult:
        """`decode` from part way, for `decoding.auto`, which hands a request over (it runs
        this under its own `decode`): `generated`, tokens already generated after the prompt
        (the particles start from them, and penalties count them as generated; the result
        holds only what follows), and `stop_when(population)`, asked after every round whether
        to stop there (the answer is then drawn from the particles as at the end)."""
        check_prompt([*call.prompt, *generated], self.target)
        guide = self._guide(call.s)
        try:
            return self._particles(call, guide, list(generated), stop_when)
        finally:
            guide.release()  # even if the job's error (and its frames) is kept

    def _guide(self, s: SamplingConfig) -> RoundGuide:
        if self.potential is None:
            return NoGuide()
        return PotentialGuide(self.potential, self.config.particles, self._eos(s), s)

    def _particles(
        self,
        call: Call,
        guide: RoundGuide,
        generated: list[int],
        stop_when: Callable[[Population], bool] | None,
    ) -> DecodeResult:
        prompt, sampling_cfg, generator, watch = call
        n = self.config.particles
        pop = Population.start(n, sampling_cfg.max_new_tokens, sampling_cfg.logprobs)
        # the particles' shared start; penalties count from the prompt's end
        with opened([*prompt, *generated], n, self.target, self.draft) as (clock, seq, caches):
            run = _Run(seq[0], len(prompt), caches, sampling_cfg, generator, clock, guide)
            rounds = 0
            stopped = False
            while pop.live.numel() > 0 and pop.generated < sampling_cfg.max_new_tokens:
                self._round(run, pop)
                rounds += 1
                if torch.isneginf(pop.log_w).all():
                    break  # every particle died (only a potential can kill them all)
                if watch is not None and watch(pop.common_prefix()):
                    stopped = True
                    break
                if stop_when is not None and stop_when(pop):
                    break
        cut = pop.cut()  # before the final factors, which zero the incomplete
        guide.finish(pop)
        weights = pop.finish()
        choice = self._draw_answer(weights, cut, generator)
        seconds, split = clock.finish()
        all_tokens = [pop.sequence(i) for i in range(n)]
        stats = SMCStats(
            stopped=stopped,
            ess=pop.ess_history,
            resamples=pop.resamples,
            collapses=pop.collapses,
            weights=weights.tolist(),
            log_z_hat=pop.log_z,
            chosen_particle=choice,
            draft_agreement=pop.agreed.mean,
            agreement_positions=pop.agreed.positions,
        )
        guide.report(stats, pop)
        logprobs = None if pop.scores is None else pop.scores.of(choice, int(pop.lengths[choice]))
        return DecodeResult(all_tokens[choice], rounds, seconds, split, stats, all_tokens, logprobs)

    def _draw_answer(
        self, weights: torch.Tensor, cut: torch.Tensor, generator: torch.Generator
    ) -> int:
        """The returned particle: i with probability W_i [N], so that the output's law is the
        expectation of the weighted particle measure sum_i W_i delta(x_i). All-zero weights
        (no particle satisfied the potentials) draw uniformly among those cut at the length
        limit (cut [N]), whose text at least starts a valid one, never a dead one."""
        if not bool(weights.sum() > 0):
            weights = cut.to(weights.dtype)
        return int(torch.multinomial(weights, 1, generator=generator))

    def _round(self, run: _Run, pop: Population) -> None:
        """One round: K draft steps, one verify pass, the weights, then resampling."""
        s, generator, guide, prompt_len = run.s, run.generator, run.guide, run.prompt_len
        t_cache = run.caches[0]
        k = min(self.config.draft_tokens, s.max_new_tokens - pop.generated - 1)
        seqs = pop.live_sequences(run.start)  # [B, L + G]
        guide.begin(pop.live.tolist())
        with run.clock.stage("draft"):
            drafts, logq_x, logq = self._propose(run, seqs, k)
        with run.clock.stage("verify"):
            feed = torch.cat([sampling.to_device(pending(seqs, t_cache), drafts.device), drafts], 1)
            logits = self.target.forward(feed, t_cache, k + 1)  # [B, k + 1, V]
            if guide.on_host:
                logits = logits.cpu()
            scores = sampling.scores(logits, s, [seqs, drafts], prompt_len)
            logp = sampling.tempered(scores, s, s.temperature)  # [B, k + 1, V], for logprobs
            law = guide.target(logp, scores)  # what the weights use (greedy: p constrained)
            # no-ops but for k = 0, whose empty drafts never met the device
            drafts = sampling.to_device(drafts, logp.device)
            logq_x = sampling.to_device(logq_x, logp.device)
            logp_x = sampling.pick(law[:, :k], drafts)  # [B, k]
            bonus, log_target_x, bonus_term = guide.bonus(law, logp_x, generator)
            # The SMC-SD weight: log w += sum_j [log pi(x_j) - log q(x_j)] + the bonus's term
            # (pi = p, whose exact bonus adds 0; with a potential, p^alpha shaped, its bonus's
            # local normalizer). [B, k + 1]
            log_ratio = torch.cat([log_target_x - logq_x, bonus_term[:, None]], dim=1)
            scored = _score(logp, drafts, bonus, s.logprobs)
            agree = agreement(logp[:, :k], sampling.to_device(logq, logp.device))  # [B, k]
            # The round's one wait for the device, after the K draft steps and the verify pass
            # are all queued: the weights, EOS and resampling below are decided on the host.
            drafts, bonus, log_ratio, agree, *scored = sampling.to_host(
                drafts, bonus, log_ratio, agree, *(scored or ())
            )
        rows_before = pop.live
        block = torch.cat([drafts, bonus[:, None]], dim=1)  # [B, k + 1]
        increment, kept, ended = self._weigh(block, log_ratio, s)  # [B] each
        pop.agreed.add(agree[torch.arange(k)[None, :] < kept[:, None]])  # up to a drafted EOS
        if guide.collapses(pop, increment):
            self._exact_step(run, pop, (law[:, 0], logp[:, 0]))
            for cache in run.caches:
                rollback(cache, run.start.numel() + pop.generated)
        else:
            pop.reweight(increment)
            pop.extend(block, kept, ended, tuple(scored) or None)
            guide.committed(pop, bonus)
        with run.clock.stage("resample"):
            self._maybe_resample(run, pop, rows_before)

    def _propose(
        self, run: _Run, seqs: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft tokens [B, k], their log proposal probability [B, k], and the draft's law q at
        each step [B, k, V] (before a potential shapes it: for `agreement`): k batched draft
        steps from the guide's proposal law (q itself without a potential). seqs [B, T]: the
        shared start and each particle's text."""
        s, guide, cache = run.s, run.guide, run.caches[1]
        b = seqs.shape[0]
        tokens: list[torch.Tensor] = []  # each [B], on the draft's device
        logq_x: list[torch.Tensor] = []
        laws: list[torch.Tensor] = []
        feed = pending(seqs, cache)
        for _ in range(k):
            logits = self.draft.forward(feed, cache, 1)[:, -1:]  # [B, 1, V]
            if guide.on_host:
                logits = logits.cpu()
            context = [seqs, *(t[:, None] for t in tokens)]
            scores = sampling.scores(logits, s, context, run.prompt_len)[:, 0]  # [B, V]
            laws.append(sampling.tempered(scores, s, s.proposal_temperature))
            logq = guide.proposal(laws[-1], scores)
            x = sampling.sample(logq, run.generator)  # [B], stays on the device: no sync
            tokens.append(x)
            logq_x.append(sampling.pick(logq, x))
            guide.drafted(x)
            feed = x[:, None]
        if k == 0:  # no draft step: the empty drafts stay on the host
            return torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0), torch.zeros(b, 0, 1)
        return torch.stack(tokens, dim=1), torch.stack(logq_x, dim=1), torch.stack(laws, dim=1)

    def _eos(self, s: SamplingConfig) -> torch.Tensor:
        ids = sorted(self.target.eos_token_ids) if s.stop_at_eos else []
        return torch.tensor(ids, dtype=torch.long)

    def _weigh(
        self, block: torch.Tensor, log_ratio: torch.Tensor, s: SamplingConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`weigh` under this request's EOS set."""
        return weigh(block, log_ratio, self._eos(s))

    def _exact_step(
        self, run: _Run, pop: Population, first: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """The round would leave every weight zero: instead of it, each live particle gets one
        token drawn exactly from the law the weights use at the round's first position (first:
        that law and p's, which logprobs report, [B, V] each), its weight unchanged but where
        the guide finds a dead end."""
        law, logp = first
        s, guide = run.s, run.guide
        pop.collapses += 1
        token = sampling.sample(law, run.generator)  # [B]
        top = s.logprobs
        scored = () if top is None else score(logp[:, None], token[:, None], top)
        # A collapsed round's second wait: which rows collapsed was known only after the first.
        token, *scored = sampling.to_host(token, *scored)
        guide.exact(pop, law, token)
        ended = torch.isin(token, self._eos(s))
        pop.extend(token[:, None], torch.ones_like(token), ended, tuple(scored) or None)
        guide.committed(pop, token)

    def _maybe_resample(self, run: _Run, pop: Population, rows_before: torch.Tensor) -> None:
        """Resample if ESS < threshold * N, then make the cache rows match the live particles.

        rows_before [B] are the particles the cache rows held at the start of the round.
        """
        n = pop.log_w.numel()
        ess = particles.ess(pop.log_w)
        pop.ess_history.append(ess)
        ancestors = torch.arange(n)
        if ess < self.config.resample_threshold * n:
            ancestors = particles.resample(pop.log_w, self.config.resampling, run.generator)
            pop.resample(ancestors)
            run.guide.reorder(ancestors)
        row_of = torch.full((n,), -1, dtype=torch.long)
        row_of[rows_before] = torch.arange(rows_before.numel())
        rows = row_of[ancestors[~pop.finished]]
        assert (rows >= 0).all(), "a live particle must descend from a cached row"
        if rows.numel() != rows_before.numel() or not torch.equal(rows, torch.arange(rows.numel())):
            for cache in run.caches:
                cache.select(rows)
