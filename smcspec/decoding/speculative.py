"""Standard speculative decoding (Leviathan et al. 2023; Chen et al. 2023). Exact.

Each round the draft q proposes x_1..x_K, the target p scores them in one pass, and x_k is kept
with probability min(1, p(x_k) / q(x_k)). At the first rejection the token is redrawn from the
residual  max(0, p - q) / Z; if all K survive, a bonus token comes from p. The committed tokens are
distributed exactly as p's.

Block verification (`verify="block"`; Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025, Algorithm 2) tests the block jointly. Write p_i, q_i for the laws of the
token after x_1..x_i (p_i at every i <= K, q_i at i < K). With

    w_0 = 1,  w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))          (the block's weight)
    r_i = sum_x max(0, w_i p_i(x) - q_i(x))                              (its residual mass)
    h_i = r_i / (r_i + 1 - w_i) for 0 < i < K,  h_K = w_K

and uniforms eta_1..eta_K, the round keeps x_1..x_tau, tau the largest i with eta_i <= h_i (0 if
none), then draws one token: from p_K if tau = K, else from max(0, w_tau p_tau - q_tau) / r_tau.
K = 1 is the token rule. Why exact (the paper's Theorem 2, sketched): w_i q(x_1..x_i) is the part
of the draft's mass on the prefix x_1..x_i that p can still claim, and h_i splits what reaches i
between stopping there (and paying the residual, whose mass r_i is exactly what p puts beyond
the drafts' share) and going on; by induction on i, the probability that the output starts with
any given i tokens is p's, for every i, which is the law of the text. Each x_i no longer needs
its own test to pass: a draft rejected token by token can be kept when later drafts make up for
it, so the expected tokens per round are at least the token rule's (the paper proves it optimal
among exact rules for one draft). A pair with w_i = 1 and r_i = 0 (p_i = q_i) leaves h_i 0 / 0:
taken as 0 (nothing to draw there), which never decides tau, since a later i then has h_i = 1.

Penalties, truncation and logit bias are in p and q as for the token rule: both rules see the
same adjusted laws (`sampling.law`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SDConfig
from smcspec.decoding import lookup
from smcspec.decoding.agreement import Tally, agreement
from smcspec.decoding.base import (
    Call,
    DecodeResult,
    Drafted,
    RoundArgs,
    SDStats,
    SharedCaches,
    Step,
    opened,
    pending,
    rollback,
)
from smcspec.decoding.logprobs import TokenLogprobs, score, to_host
from smcspec.models.base import KVCache


class SDRound(NamedTuple):
    """One round's outcome: the committed tokens, the drafts accepted and checked, whether an
    EOS ended decoding, `agreement` at the drafts checked, their scores when asked for."""

    block: list[int]
    accepted: int
    checked: int
    done: bool
    agreement: torch.Tensor
    scored: TokenLogprobs | None


class SpeculativeDecoder(Drafted[SDConfig]):
    def _decode(self, call: Call) -> DecodeResult:
        prompt, s, generator, watch = call
        # lookup alone never runs the draft model: no cache of its own to fill
        draft = self.draft if self.config.proposal != "lookup" else None
        with opened(prompt, 1, self.target, draft) as (clock, seq, (t_cache, d_cache)):
            new: list[int] = []
            rounds = proposed = accepted_total = 0
            done = stopped = False
            scores: list[TokenLogprobs] = []
            agreed = Tally()
            args = RoundArgs(s, generator, clock, len(prompt))
            while not done and len(new) < s.max_new_tokens:
                k = min(self.config.draft_tokens, s.max_new_tokens - len(new) - 1)
                r = self.round(seq, (t_cache, d_cache), k, args)
                agreed.add(r.agreement)
                rounds += 1
                proposed += r.checked
                accepted_total += r.accepted
                done = r.done
                if r.scored is not None:
                    scores.append(r.scored)
                new.extend(r.block)
                seq = torch.cat([seq, torch.tensor([r.block])], dim=1)
                rollback(t_cache, seq.shape[1])
                if d_cache is not None:
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
            draft_agreement=agreed.mean,
            agreement_positions=agreed.positions,
        )
        return DecodeResult(new, rounds, seconds, split, stats, logprobs=logprobs)

    def step(
        self, seq: torch.Tensor, caches: SharedCaches, remaining: int, args: RoundArgs
    ) -> Step:
        """One round for auto over its shared caches (see `base.Step`), at most `remaining`
        tokens; the caches are left holding the committed text in one row."""
        with args.clock.stage("prefill"):
            draft_cache = caches.draft(seq[0])
        pair = (caches.rows(caches.target, 1), caches.rows(draft_cache, 1))
        k = min(self.config.draft_tokens, remaining - 1)
        r = self.round(seq, pair, k, args)
        caches.restart(seq.shape[1] + len(r.block), 1)
        return Step(r.block, r.done, r.checked, r.accepted, r.agreement, r.scored)

    def round(
        self, seq: torch.Tensor, caches: tuple[KVCache, KVCache], k: int, args: RoundArgs
    ) -> SDRound:
        """One round of K drafts from seq [1, T] (the prompt, prompt_len tokens, and the text so
        far), over one row of each cache; the caller crops them (`rollback`) after it."""
        t_cache, d_cache = caches
        s, generator, clock, prompt_len = args
        with clock.stage("draft"):
            drafts, logq = self._propose(seq, d_cache, k, args)
        k = drafts.numel()  # a lookup may find fewer than K, or none
        with clock.stage("verify"):
            head = sampling.to_device(pending(seq, t_cache), drafts.device)
            feed = torch.cat([head, drafts[None]], 1)
            logits = self.target.forward(feed, t_cache, k + 1)  # [1, k + 1, V]
            context = [seq, drafts[None]]
            logp = sampling.law(logits, s, s.temperature, context, prompt_len)[0]
        block, n_accepted, n_checked, done, agree = self._accept(drafts, logq, logp, s, generator)
        # block[i] was drawn at position i of the round
        scored = None if s.logprobs is None else _score(logp[: len(block)], block, s.logprobs)
        return SDRound(block, n_accepted, n_checked, done, agree, scored)

    def _propose(
        self, seq: torch.Tensor, cache: KVCache, k: int, args: RoundArgs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K draft tokens [k] and the draft law q at each of them [k, V]. seq [1, T]: the
        prompt (prompt_len tokens) and the text so far. With a lookup proposal, the tokens
        that followed the text's last n-gram before (up to K, maybe none) and their point
        masses; with "lookup+draft" the draft model where the lookup finds nothing."""
        s, generator, _, prompt_len = args
        if self.config.proposal != "draft":
            found = lookup.continuation(seq[0].tolist(), k, self.config.lookup_ngram)
            if found or self.config.proposal == "lookup":
                tokens_found = torch.tensor(found, dtype=torch.long)
                return tokens_found, lookup.point_masses(found, self.target.vocab_size)
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
    ) -> tuple[list[int], int, int, bool, torch.Tensor]:
        """Rejection step. Returns (committed tokens, #accepted drafts, #drafts checked, ended,
        `agreement` at the drafts checked [#drafts checked]). drafts [k], logq [k, V],
        logp [k + 1, V].

        Draft i is kept if u_i < p(x_i) / q(x_i). The first rejected one is replaced by a draw
        from the residual, or, if all K are kept, a bonus token comes from p: that draw takes
        the uniform after the last test's. So all K + 1 uniforms are drawn at once and every
        test and the final draw run on the device, read back in one wait; the generator then
        moves on by the uniforms a test-by-test loop would have drawn (it stops at an EOS it
        keeps, and draws nothing after), so a seed gives the same tokens as that loop (a CPU
        generator draws a vector's numbers one after another, as that loop's)."""
        k = drafts.numel()
        state = generator.get_state()
        u = sampling.uniforms((k + 1,), generator, logp.device)  # [k + 1]
        block_rule = self.config.verify == "block"
        accepted, final = self._decide(drafts, logq, logp, u)
        agree = agreement(logp[:k], sampling.to_device(logq, logp.device))  # [k]
        # The round's one wait for the device, after the K draft steps and the verify pass.
        drafts, accepted, final, agree = sampling.to_host(drafts, accepted, final, agree)
        block, n = drafts.tolist(), int(accepted)
        eos = self.target.eos_token_ids if s.stop_at_eos else frozenset()
        end = next((i for i, x in enumerate(block[:n]) if x in eos), None)
        if end is not None:  # a kept EOS: no later test, no final draw
            _advance(generator, state, k + 1 if block_rule else end + 1)
            return block[: end + 1], end + 1, end + 1, True, agree[: end + 1]
        # the block rule reads every uniform, the token rule those up to its final draw
        _advance(generator, state, k + 1 if block_rule else min(n + 2, k + 1))
        token = int(final)
        checked = min(n + 1, k)
        return [*block[:n], token], n, checked, token in eos, agree[:checked]

    def _decide(
        self, drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts kept, []; the final token, []) by the configured rule."""
        rule = _decide_block if self.config.verify == "block" else _decide
        return rule(drafts, logq, logp, u)


def _decide(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection step on the device, no host sync: (n, the drafts [k] kept before the first
    rejection, []; the final token, []), with draft i kept if u_i < p(x_i) / q(x_i) and the
    final token drawn at the uniform after the last test's: at u_{n+1} from the residual at
    draft n, or at u_k from p after all k. logq [k, V], logp [k + 1, V], u [k + 1]."""
    k = drafts.numel()
    if k == 0:
        none = torch.zeros((), dtype=torch.long, device=logp.device)
        return none, sampling.sample_at(logp[0], u[0])
    ratio = torch.exp(sampling.pick(logp[:k], drafts) - sampling.pick(logq, drafts))  # [k]
    n = (u[:k] < ratio.clamp(max=1.0)).long().cumprod(dim=0).sum()  # []
    # rows picked by a device index: indexing with a tensor scalar would read it on the host
    at = n.clamp(max=k - 1)[None]  # [1] the first rejected draft, or the last draft
    residual = _residual(logp.index_select(0, at)[0], logq.index_select(0, at)[0])
    law = torch.where(n < k, residual, logp.index_select(0, n[None])[0].double())  # [V]
    return n, sampling.sample_at(law, u.index_select(0, at + 1)[0])


def _decide_block(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification on the device, no host sync (the module docstring): (tau, [];
    the final token, []), with eta_i = u_{i-1} and the final token drawn at u_k. logq [k, V],
    logp [k + 1, V], u [k + 1]."""
    k = drafts.numel()
    if k == 0:
        none = torch.zeros((), dtype=torch.long, device=logp.device)
        return none, sampling.sample_at(logp[0], u[0])
    tau, _, rest = block_stop(drafts, logq, logp, u[:k])
    total = rest.sum()
    at = tau.clamp(max=k - 1)[None]  # [1]
    own = logp.index_select(0, at)[0].double()  # p_tau, where the residual vanishes numerically
    residual = torch.where(total > 0, (rest / total.clamp_min(1e-300)).log(), own)
    law = torch.where(tau < k, residual, logp.index_select(0, tau[None])[0].double())  # [V]
    return tau, sampling.sample_at(law, u[k])


def block_stop(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, eta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where block verification stops (the module docstring), no host sync: (tau [], the
    block's weight w_tau [], and max(0, w_tau p_tau - q_tau) [V], the unnormalised residual
    the final token is drawn from when tau < k; at tau = k, the last draft's). drafts [k >= 1],
    logq [k, V], logp [k + 1, V], eta [k]; float64 results."""
    k = drafts.numel()
    p, q = logp[:k].double().exp(), logq.double().exp()  # [k, V] each
    log_ratio = sampling.pick(logp[:k], drafts).double() - sampling.pick(logq, drafts).double()
    log_w = [torch.zeros((), dtype=torch.float64, device=logp.device)]
    for i in range(k):  # w_i = min(1, w_{i-1} p/q(x_i)), K <= a few dozen steps
        log_w.append((log_w[-1] + log_ratio[i]).clamp(max=0.0))
    w = torch.stack(log_w).exp()  # [k + 1]
    excess = (w[:k, None] * p - q).clamp_min(0.0)  # [k, V] max(0, w_i p_i - q_i)
    r = excess.sum(-1)  # [k]
    denominator = r + 1 - w[:k]
    h = torch.where(denominator > 0, r / denominator.clamp_min(1e-300), torch.zeros_like(r))
    h = torch.cat([h[1:], w[k:]])  # [k] h_1..h_K (h_0 is no test: tau = 0 is the default)
    stops = (eta <= h).long() * torch.arange(1, k + 1, device=logp.device)  # [k]
    tau = stops.max()  # [] the largest i with eta_i <= h_i, 0 if none
    at = tau.clamp(max=k - 1)[None]  # [1]
    return tau, w.index_select(0, tau[None])[0], excess.index_select(0, at)[0]


def _advance(generator: torch.Generator, state: torch.Tensor, used: int) -> None:
    """Set generator to `state` moved on by `used` uniforms, as if only those had been drawn."""
    generator.set_state(state)
    torch.rand(used, generator=generator, device=generator.device, dtype=torch.float64)


def _residual(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log of  max(0, p - q) / Z  [V] (float64); p itself (float64) if the residual vanishes
    numerically. No host sync."""
    diff = (logp.double().exp() - logq.double().exp()).clamp_min(0.0)
    total = diff.sum()
    return torch.where(total <= 0, logp.double(), (diff / total).log())


def _score(logp: torch.Tensor, block: list[int], top: int) -> TokenLogprobs:
    """The block's tokens under the target's law at their positions (logp [len(block), V])."""
    # the round's second wait: the block is known only after the first
    return to_host(*score(logp, sampling.to_device(torch.tensor(block), logp.device), top))
