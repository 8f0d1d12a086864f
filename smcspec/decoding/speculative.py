"""Standard speculative decoding (Leviathan et al. 2023; Chen et al. 2023). Exact.

Each round the draft q proposes x_1..x_K, the target p scores them in one pass, and x_k is kept
with probability min(1, p(x_k) / q(x_k)). At the first rejection the token is redrawn from the
residual  max(0, p - q) / Z; if all K survive, a bonus token comes from p. The committed tokens are
distributed exactly as p's.
"""

from __future__ import annotations

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SDConfig
from smcspec.decoding.base import (
    DecodeResult,
    SDStats,
    StageClock,
    Watch,
    check_prompt,
    pending,
    released,
    rollback,
    start_cache,
)
from smcspec.decoding.logprobs import TokenLogprobs, score, to_host
from smcspec.models.base import CausalLM


class SpeculativeDecoder:
    def __init__(self, target: CausalLM, draft: CausalLM, config: SDConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config

    def decode(
        self,
        prompt: list[int],
        sampling_cfg: SamplingConfig,
        generator: torch.Generator,
        watch: Watch | None = None,
    ) -> DecodeResult:
        check_prompt(prompt, self.target)
        clock = StageClock()
        s = sampling_cfg
        seq = torch.tensor([prompt], dtype=torch.long)  # [1, L]
        with released() as held:
            with clock.stage("prefill"):
                t_cache = start_cache(self.target, seq[0], 1, held)
                d_cache = start_cache(self.draft, seq[0], 1, held)
            new: list[int] = []
            rounds = proposed = accepted_total = 0
            done = stopped = False
            scores: list[TokenLogprobs] = []
            while not done and len(new) < s.max_new_tokens:
                k = min(self.config.draft_tokens, s.max_new_tokens - len(new) - 1)
                with clock.stage("draft"):
                    drafts, logq = self._propose(seq, d_cache, k, s, generator, len(prompt))
                with clock.stage("verify"):
                    feed = torch.cat([pending(seq, t_cache).to(drafts.device), drafts[None]], 1)
                    logits = self.target.forward(feed, t_cache, k + 1)  # [1, k + 1, V]
                    context = [seq, drafts[None]]
                    logp = sampling.law(logits, s, s.temperature, context, len(prompt))[0]
                block, n_accepted, n_checked, done = self._accept(drafts, logq, logp, s, generator)
                rounds += 1
                proposed += n_checked
                accepted_total += n_accepted
                block = block[: s.max_new_tokens - len(new)]
                if s.logprobs is not None:  # block[i] was drawn at position i of the round
                    scores.append(_score(logp[: len(block)], block, s.logprobs))
                new.extend(block)
                seq = torch.cat([seq, torch.tensor([block])], dim=1)
                rollback(t_cache, seq.shape[1])
                rollback(d_cache, seq.shape[1])
                if not done and watch is not None and watch(new):
                    stopped = done = True
        seconds, split = clock.finish()
        logprobs = TokenLogprobs.join(scores) if s.logprobs is not None else None
        stats = SDStats(
            stopped=stopped,
            proposed_tokens=proposed,
            accepted_tokens=accepted_total,
            acceptance_rate=accepted_total / proposed if proposed else None,
            mean_accepted_length=accepted_total / rounds if rounds else None,
            tokens_per_round=len(new) / rounds if rounds else None,
        )
        return DecodeResult(new, rounds, seconds, split, stats, logprobs=logprobs)

    def _propose(
        self,
        seq: torch.Tensor,
        cache,
        k: int,
        s: SamplingConfig,
        generator: torch.Generator,
        prompt_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K draft tokens [k] and the draft law q at each of them [k, V]. seq [1, T]: the
        prompt (prompt_len tokens) and the text so far."""
        tokens: list[torch.Tensor] = []
        laws: list[torch.Tensor] = []
        feed = pending(seq, cache)
        for _ in range(k):
            logits = self.draft.forward(feed, cache, 1)[:, -1:]  # [1, 1, V]
            context = [seq, *(t.view(1, 1) for t in tokens)]
            logq = sampling.law(logits, s, s.proposal_temperature, context, prompt_len)[0, 0]
            x = sampling.sample(logq, generator)
            tokens.append(x)
            laws.append(logq)
            feed = x.view(1, 1)
        if k == 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, self.draft.vocab_size)
        return torch.stack(tokens), torch.stack(laws)

    def _accept(
        self,
        drafts: torch.Tensor,
        logq: torch.Tensor,
        logp: torch.Tensor,
        s: SamplingConfig,
        generator: torch.Generator,
    ) -> tuple[list[int], int, int, bool]:
        """Rejection step. Returns (committed tokens, #accepted drafts, #drafts checked, ended)."""
        eos = self.target.eos_token_ids
        block: list[int] = []
        k = drafts.numel()
        # p(x) / q(x) of every draft, brought to the host at once (one sync a round)
        ratios = torch.zeros(0)
        if k > 0:  # (with k = 0 the empty drafts never met the device)
            ratios = torch.exp(sampling.pick(logp[:k], drafts) - sampling.pick(logq, drafts))
            ratios = ratios.clamp(max=1.0).cpu()  # [k]
        for i, x in enumerate(drafts.tolist()):
            ratio = ratios[i]
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if u < ratio:
                block.append(x)
                if s.stop_at_eos and x in eos:
                    return block, i + 1, i + 1, True
                continue
            token = int(sampling.sample(_residual(logp[i], logq[i]), generator))
            block.append(token)
            return block, i, i + 1, s.stop_at_eos and token in eos
        token = int(sampling.sample(logp[len(block)], generator))
        block.append(token)
        return block, len(drafts), len(drafts), s.stop_at_eos and token in eos


def _residual(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log of  max(0, p - q) / Z  [V]; falls back to p if the residual vanishes numerically."""
    diff = (logp.double().exp() - logq.double().exp()).clamp_min(0.0)
    total = diff.sum()
    if total <= 0:
        return logp
    return (diff / total).log()


def _score(logp: torch.Tensor, block: list[int], top: int) -> TokenLogprobs:
    """The block's tokens under the target's law at their positions (logp [len(block), V])."""
    return to_host(*score(logp, torch.tensor(block, device=logp.device), top))
