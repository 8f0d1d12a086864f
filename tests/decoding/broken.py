"""Deliberately broken samplers: each is a bug a careful implementer could plausibly make, and
each statistical test of the suite is shown to reject at least one of them (the power checks).
A test that no realistic bug can fail would prove nothing.

Bug -> what it does wrong -> the test that rejects it:
- NoDraftCorrection: weights sum log p, forgetting - log q -> rates, Z-hat, unnormalized measure
- WrongWeightSign: weights grow by log q - log p -> unnormalized measure
- UniformFinalDraw: the answer ignores the weights -> both returned-law tests
- ForgetsBonusNormalizer: a shaped bonus token's normalizer is dropped -> Z-hat with a potential
- WrongDraftTemperatureWeights: q scored at the target's temperature -> unnormalized measure
- SDWithoutResidual: a rejected draft is redrawn from p, not (p - q)+ -> sd chi-square
- SDOneUniformPerRound: one uniform decides all K accept tests of a round -> sd chi-square
- adjust_with_stale_context: a verify pass's positions penalized for the text before the round,
  forgetting the drafts they follow -> sd chi-square, smc unnormalized measure
- adjust_counting_the_prompt: presence / frequency counted over the prompt too -> ar chi-square
- MSDResidualNotUpdated: r = (p - q)+ after a node's first rejection, never after the later ones
  -> msd chi-square
- MSDTestsAgainstP: every draft after the first checked against p, not the residual (the final
  draw still from the right residual) -> msd chi-square
- MSDKeepsMismatchedDrafts: after an acceptance, drafts whose token differs stay alive -> msd
  chi-square
- MSDBonusFromDraft: when all K are accepted the draft's own next token is the bonus, not a draw
  from p -> msd chi-square
- MSDBlockReusesStoppedDraft (msd's block rule): the draft whose block stopped stays alive and
  is tested again at the stop, though its test read its later tokens -> msd block chi-square
- MSDBlockTokenResidual (msd's block rule): the other drafts are tested against the token rule's
  residual (p - q)+ at the stop, not block verification's (w p - q)+ -> msd block chi-square
- ancestors_ignoring_weights: resampling draws ancestors from equal weights -> smc unnormalized
  measure with resampling between rounds, every scheme
- resample_keeping_weights: the copies keep their ancestor's weight -> the same test
"""

from __future__ import annotations

import math

import torch

from smcspec import sampling
from smcspec.decoding import particles
from smcspec.decoding.agreement import agreement
from smcspec.decoding.msd import MultiDraftDecoder
from smcspec.decoding.population import Population
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.smc_guide import PotentialGuide
from smcspec.decoding.speculative import SpeculativeDecoder


class NoDraftCorrection(SMCDecoder):
    """Weights use log p only: the proposal's log q is dropped."""

    def _propose(self, run, seqs, k):
        tokens, logq_x, laws = super()._propose(run, seqs, k)
        return tokens, torch.zeros_like(logq_x), laws


class WrongWeightSign(SMCDecoder):
    """The incremental weight is q / p instead of p / q."""

    def _weigh(self, block, log_ratio, s):
        return super()._weigh(block, -log_ratio, s)


class UniformFinalDraw(SMCDecoder):
    """Returns a particle chosen uniformly: right particles and weights, wrong answer."""

    def _draw_answer(self, weights, cut, generator):
        return super()._draw_answer(torch.ones_like(weights), cut, generator)


class ForgetsBonusNormalizer(SMCDecoder):
    """With a potential, the bonus token's local normalizer (a weight term) is dropped."""

    def _guide(self, s):
        return _NoBonusNormalizer(self.potential, self.config.particles, self._eos(s), s)


class _NoBonusNormalizer(PotentialGuide):
    def bonus(self, *args):
        bonus, log_target, term = super().bonus(*args)
        return bonus, log_target, torch.where(torch.isneginf(term), term, 0.0)


class WrongDraftTemperatureWeights(SMCDecoder):
    """Drafts at `draft_temperature` but weights with q at the target's temperature."""

    def _propose(self, run, seqs, k):
        tokens, logq_x, laws = super()._propose(run, seqs, k)
        s = run.s
        # Re-score the drafts under q at the target temperature, on a fresh pass of the toy draft.
        logq_wrong = torch.zeros_like(logq_x)
        for row in range(seqs.shape[0]):
            prefix = tuple(seqs[row].tolist())
            for i in range(k):
                logits = self.draft.logits(prefix + tuple(tokens[row, :i].tolist()))
                logq = sampling.log_probs(logits, s.temperature, s.top_k, s.top_p)
                logq_wrong[row, i] = logq[tokens[row, i]]
        return tokens, logq_wrong, laws


class SDWithoutResidual(SpeculativeDecoder):
    """After a rejection the token is redrawn from p instead of the residual max(0, p - q)."""

    def _accept(self, drafts, logq, logp, s, generator):
        return _accept(self, drafts, logq, logp, s, generator, residual=False)


class SDOneUniformPerRound(SpeculativeDecoder):
    """One uniform u decides every accept test of a round (they must be independent)."""

    def _accept(self, drafts, logq, logp, s, generator):
        return _accept(self, drafts, logq, logp, s, generator, shared_uniform=True)


def _accept(dec, drafts, logq, logp, s, generator, residual=True, shared_uniform=False):
    """The rejection step of `SpeculativeDecoder._accept`, with one of the two bugs switched on."""
    from smcspec.decoding.speculative import _residual

    eos = dec.target.eos_token_ids
    block: list[int] = []
    u_shared = torch.rand((), generator=generator, dtype=torch.float64)
    for i, x in enumerate(drafts.tolist()):
        ratio = torch.exp(logp[i, x] - logq[i, x]).clamp(max=1.0)
        u = u_shared if shared_uniform else torch.rand((), generator=generator, dtype=torch.float64)
        if u < ratio:
            block.append(x)
            if s.stop_at_eos and x in eos:
                return block, i + 1, i + 1, True, agreement(logp[: i + 1], logq[: i + 1])
            continue
        law = _residual(logp[i], logq[i]) if residual else logp[i]
        token = int(sampling.sample(law, generator))
        block.append(token)
        done = s.stop_at_eos and token in eos
        return block, i, i + 1, done, agreement(logp[: i + 1], logq[: i + 1])
    token = int(sampling.sample(logp[len(block)], generator))
    block.append(token)
    done = s.stop_at_eos and token in eos
    return block, len(drafts), len(drafts), done, agreement(logp[: len(drafts)], logq)


def tree_walk(drafts, logq, logp, u, bug=None, bonus=None):
    """`msd.verify` one test at a time, as SpecInfer's algorithm box reads: the reference the
    vectorised walk is held to (bug None), and the msd bugs above. The same uniforms: draft j's
    test at depth d takes u[d N + j], the final draw u[-1]. bonus: the tokens [N] that replace
    the bonus draw (MSDBonusFromDraft)."""
    n, k = drafts.shape
    alive, path, winner = list(range(n)), [], 0
    for d in range(k):
        p = logp[winner, d].double().exp()
        r, kept = p, None
        for j in alive:
            q, x = logq[j, d].double().exp(), int(drafts[j, d])
            law = p if bug == "tests against p" and j != alive[0] else r
            if u[d * n + j] < law[x] / q[x]:
                kept = j
                break
            if not (bug == "residual not updated" and j != alive[0]):
                rest = (r - q).clamp_min(0)
                r = rest / rest.sum() if rest.sum() > 0 else p
        if kept is None:
            return _walked(path, sampling.sample_at(r.log(), u[-1]), winner)
        winner = kept
        path.append(int(drafts[kept, d]))
        if bug != "keeps mismatched drafts":
            alive = [j for j in alive if drafts[j, d] == drafts[kept, d]]
    token = bonus[winner] if bonus is not None else sampling.sample_at(logp[winner, k], u[-1])
    return _walked(path, token, winner)


def _walked(path, token, winner):
    """`msd.verify`'s outputs: (path [k + 1] padded with the token, depth [], winner [])."""
    depth = len(path)
    tokens = torch.tensor([*path, int(token)])
    return tokens, torch.tensor(depth), torch.tensor(winner)


class MSDReference(MultiDraftDecoder):
    """msd with a plain walk (`tree_walk`; `multipath_walk` for the block rule) in place of
    the vectorised one, with `bug` switched on."""

    bug = None
    walk = staticmethod(tree_walk)

    def _verify(self, drafts, logq, logp, u, found=()):
        width = drafts.shape[1] + 1
        path, depth, winner = self.walk(drafts, logq, logp, u, self.bug)
        return torch.cat([path, path[-1:].expand(width - path.numel())]), depth, winner


class MSDResidualNotUpdated(MSDReference):
    bug = "residual not updated"


class MSDTestsAgainstP(MSDReference):
    bug = "tests against p"


class MSDKeepsMismatchedDrafts(MSDReference):
    bug = "keeps mismatched drafts"


class MSDBonusFromDraft(MultiDraftDecoder):
    """Drafts K + 1 tokens a row and, when all K are accepted, commits the winner's last one."""

    def _propose(self, seqs, cache, k, args, found=()):
        drafts, logq = super()._propose(seqs, cache, k + 1, args, found)
        self.extra = drafts[:, k]
        return drafts[:, :k], logq[:, :k]

    def _verify(self, drafts, logq, logp, u, found=()):
        width = drafts.shape[1] + 1
        path, depth, winner = tree_walk(drafts, logq, logp, u, bonus=self.extra)
        return torch.cat([path, path[-1:].expand(width - path.numel())]), depth, winner


_adjust = sampling.adjust


def adjust_with_stale_context(logits, tokens, prompt_len, cfg):
    """`sampling.adjust` with every position of a block scored after the text before the block:
    the drafts a position follows are left out of its counts."""
    start = tokens.shape[1] - logits.shape[1] + 1
    context = tokens[:, :start]
    return torch.cat(
        [_adjust(logits[:, j : j + 1], context, prompt_len, cfg) for j in range(logits.shape[1])],
        dim=1,
    )


def adjust_counting_the_prompt(logits, tokens, prompt_len, cfg):
    """`sampling.adjust` with the prompt's tokens counted by the presence and frequency
    penalties (OpenAI's count the generated text only)."""
    return _adjust(logits, tokens, 0, cfg)


_resample = particles.resample


def ancestors_ignoring_weights(
    log_w: torch.Tensor, scheme: str, generator: torch.Generator
) -> torch.Tensor:
    """`particles.resample` from equal weights, as when the weights are reset before the
    ancestors are drawn from them. Multinomial then draws uniform ancestors; the low-variance
    schemes give every particle one copy, so the particles stay put while their weights are
    wiped. Z-hat still takes the right mean weight, so E[Z-hat] = 1 holds: only the measure
    E[Z-hat m] shows the bias."""
    return _resample(torch.zeros_like(log_w), scheme, generator)


_population_resample = Population.resample


def resample_keeping_weights(pop: Population, ancestors: torch.Tensor) -> None:
    """`Population.resample` whose copies keep their ancestor's weight instead of the uniform
    reset: a heavy particle counts twice, in its copies and in their weights, and Z-hat takes
    the same weights again at the next resampling or at the end."""
    log_w = pop.log_w[ancestors]
    _population_resample(pop, ancestors)
    pop.log_w = log_w


def block_walk(drafts, logq, logp, u, bug=None):
    """Block verification (Sun et al., Algorithm 2) as a plain loop in float64 over Python
    numbers, sharing no code with `speculative._decide_block`: (tau, the final token). eta_i
    is u[i - 1], the final token is drawn at u[k] by inverting the CDF in token order. bug:
    "token residual": the residual of the token rule, max(0, p - q), unweighted by w_tau;
    "first failure": tau is the last i before the first failed test, as the token rule walks;
    "stale weight": h_i computed with w_{i-1} for w_i."""
    k = len(drafts)
    p = [[math.exp(v) for v in row] for row in logp.double().tolist()]
    q = [[math.exp(v) for v in row] for row in logq.double().tolist()]
    eta = u.double().tolist()
    w = [1.0]
    for i in range(k):
        x = drafts[i]
        w.append(min(1.0, w[i] * p[i][x] / q[i][x]))
    h, excess = [], []
    for i in range(k):
        weight = w[i] if bug != "stale weight" else w[max(i - 1, 0)]
        row = [max(0.0, weight * pp - qq) for pp, qq in zip(p[i], q[i], strict=True)]
        excess.append([max(0.0, w[i] * pp - qq) for pp, qq in zip(p[i], q[i], strict=True)])
        r = sum(row)
        h.append(r / (r + 1 - weight) if r + 1 - weight > 0 else 0.0)
    h = [*h[1:], w[k]]  # h_1 .. h_K
    passed = [eta[i - 1] <= h[i - 1] for i in range(1, k + 1)]
    if bug == "first failure":
        tau = next((i for i, ok in enumerate(passed) if not ok), k)
    else:
        tau = max((i for i in range(1, k + 1) if passed[i - 1]), default=0)
    if tau == k:
        law = p[k]
    elif bug == "token residual":
        law = [max(0.0, pp - qq) for pp, qq in zip(p[tau], q[tau], strict=True)]
    else:
        law = excess[tau]
    total = sum(law)
    law = p[tau] if total <= 0 else law
    total = sum(law)
    acc, token = 0.0, len(law) - 1
    for t, mass in enumerate(law):
        acc += mass / total
        if eta[k] < acc:
            token = t
            break
    return tau, token


class SDBlockBroken(SpeculativeDecoder):
    """sd with `verify="block"` whose decision is `block_walk` with one bug switched on."""

    def __init__(self, target, draft, config, bug):
        super().__init__(target, draft, config)
        self.bug = bug

    def _decide(self, drafts, logq, logp, u):
        tau, token = block_walk(drafts.tolist(), logq, logp, u, self.bug)
        return torch.tensor(tau), torch.tensor(token)


class SDLookupWithDraftQ(SpeculativeDecoder):
    """Prompt lookup whose drafts are tested as if the draft model had proposed them: the
    ratio and the residual take the draft model's q at the looked-up tokens, not the lookup's
    point mass (where no lookup matches, the draft model proposes, as "lookup+draft")."""

    def _propose(self, seq, cache, k, args):
        from smcspec.decoding.base import pending
        from smcspec.decoding.lookup import continuation

        found = continuation(seq[0].tolist(), k, self.config.lookup_ngram)
        if not found:
            return super()._propose(seq, cache, k, args)
        s, _, _, prompt_len = args
        feed, laws = pending(seq, cache), []
        for i, x in enumerate(found):
            logits = self.draft.forward(feed, cache, 1)[:, -1:]
            context = [seq, torch.tensor([found[:i]], dtype=torch.long)]
            laws.append(sampling.law(logits, s, s.proposal_temperature, context, prompt_len)[0, 0])
            feed = torch.tensor([[x]])
        return torch.tensor(found), torch.stack(laws)


def multipath_walk(drafts, logq, logp, u, bug=None):
    """`msd_block.verify` as a plain loop over Python floats, sharing no code with it: block
    verification along the active draft (as `block_walk` computes it), and at its stop the other
    alive drafts tested one at a time against the residual, iterated (no closed form). The same
    uniforms: u[d N + j] is draft j's eta or test at depth d, the final draw u[-1]. bug:
    "stopped draft reused" or "token residual at the stop" (the header's two msd block bugs)."""
    n, k = drafts.shape
    rows = drafts.tolist()
    p = [[[math.exp(v) for v in law] for law in row] for row in logp.double().tolist()]
    q = [[[math.exp(v) for v in law] for law in row] for row in logq.double().tolist()]
    uu = u.double().tolist()
    spent, active, start, path = set(), 0, 0, []
    while True:
        eta = [uu[d * n + active] for d in range(start, k)]
        tau, w = _block_stop(rows[active][start:], p[active][start:], q[active][start:], eta)
        path += rows[active][start : start + tau]
        depth = start + tau
        if depth == k:
            return _walked(path, _draw(p[active][k], uu[-1]), active)
        if bug != "stopped draft reused":
            spent.add(active)
        weight = 1.0 if bug == "token residual at the stop" else w
        here, law = p[active][depth], q[active][depth]
        r = _normalised([max(0.0, weight * a - b) for a, b in zip(here, law, strict=True)], here)
        kept = None
        for j in range(n):
            if j in spent or rows[j][:depth] != path:
                continue
            x = rows[j][depth]
            if uu[depth * n + j] < r[x] / q[j][depth][x]:
                kept = j
                break
            r = _normalised([max(0.0, a - b) for a, b in zip(r, q[j][depth], strict=True)], here)
        if kept is None:
            return _walked(path, _draw(r, uu[-1]), active)
        path.append(rows[kept][depth])
        active, start = kept, depth + 1
        if start == k:
            return _walked(path, _draw(p[active][k], uu[-1]), active)


def _block_stop(drafts, p, q, eta):
    """Block verification's stop over Python floats (the laws along one draft from its start):
    (tau, w_tau)."""
    k = len(drafts)
    w = [1.0]
    for i, x in enumerate(drafts):
        w.append(min(1.0, w[i] * p[i][x] / q[i][x]))
    h = []
    for i in range(1, k):
        r = sum(max(0.0, w[i] * a - b) for a, b in zip(p[i], q[i], strict=True))
        h.append(r / (r + 1 - w[i]) if r + 1 - w[i] > 0 else 0.0)
    h.append(w[k])  # h_1 .. h_K
    tau = max((i for i in range(1, k + 1) if eta[i - 1] <= h[i - 1]), default=0)
    return tau, w[tau]


def _normalised(mass, fallback):
    total = sum(mass)
    return [v / total for v in mass] if total > 0 else fallback


def _draw(law, u):
    """The token at which law's CDF, in token order, first exceeds u times its total."""
    total, acc = sum(law), 0.0
    for t, mass in enumerate(law):
        acc += mass / total
        if u < acc:
            return t
    return len(law) - 1


class MSDBlockReference(MSDReference):
    """msd whose block rule is the plain loop (`multipath_walk`)."""

    walk = staticmethod(multipath_walk)


class MSDBlockReusesStoppedDraft(MSDBlockReference):
    bug = "stopped draft reused"


class MSDBlockTokenResidual(MSDBlockReference):
    bug = "token residual at the stop"


class MSDLookupWithDraftQ(MultiDraftDecoder):
    """msd's lookup draft tested as if the draft model had proposed it: the walk reads row 0's
    model q at the looked-up tokens (the draft model was fed them), not their point masses."""

    def _propose(self, seqs, cache, k, args, found=()):
        drafts, self.model_q = super()._propose(seqs, cache, k, args, found)
        return drafts, self.model_q

    def _verify(self, drafts, logq, logp, u, found=()):
        return super()._verify(drafts, self.model_q, logp, u, found)
