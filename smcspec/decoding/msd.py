"""Exact multi-draft speculative decoding (SpecInfer's multi-round speculative sampling with
i.i.d. drafts; Miao et al. 2023). N = 1 is standard speculative decoding.

Each round, over N rows forked from the committed prefix:
    x^j_{1..K} ~ q, j = 1..N          (draft: K batched steps, one row per draft)
    p(. | x^j_{<d}), d = 1..K+1        (target: ONE batched pass over N x (K+1) positions)
The drafts form a token tree, walked from the root. At a node with target law p and draft law q,
r = p, and each draft j still alive there, in the order 1..N, is tested:
    accept x^j_d  w.p.  min(1, r(x^j_d) / q(x^j_d)),   else  r <- max(r - q, 0) / Z.
On acceptance the drafts whose token at depth d is x^j_d stay alive and the walk goes one level
deeper; when every alive draft is rejected a token is drawn from r and the round ends; past
depth K the bonus token is drawn from p. Every row then restarts from the accepted path: the
winner's row forked N times (page tables, no KV copy) and cropped to the committed length.

Why the committed tokens follow p exactly. Given all the walk has read before a node (the
drafts' shallower tokens, the uniforms of the tests above), the m drafts alive there have
tokens at this depth i.i.d. from q: drafts are independent, and whether one is alive depends
only on tokens above this depth and on those uniforms; each test and the final draw take a
uniform of their own. Testing m i.i.d. draws from q in turn against the residual, then drawing
from the last residual, emits y with probability r(y): for m = 0 it is a draw from r; for
m >= 1 the first draw is kept as y with probability q(y) min(1, r(y) / q(y)) = min(r, q)(y),
rejected with Z = 1 - sum min(r, q) = sum (r - q)+, and then (by induction on m, with the other
m - 1 draws, independent of the first) emits y with probability (r - q)+(y) / Z; in all
min(r, q)(y) + (r - q)+(y) = r(y). Started from r = p, each node emits its token from
p(. | path) whatever the past, and the bonus is a draw from p. A rejected draft never carries
the accepted token (it was rejected, so r(x) < q(x), and the residual then gives x nothing): the
next depth's alive drafts are exactly those that drew it, i.i.d. from q given the new prefix.

The residual after m rejections at a node, r_m = (p - c_m q)+ / S_m with c_0 = 0, S_m =
sum (p - c_m q)+ and c_{m+1} = c_m + S_m, does not depend on which tokens were rejected, so
`residual_scales` computes it at a node in N passes over the vocabulary, and the tests of a
depth run at once. Rows alive at a node share its prefix, so their laws there are one p and one
q; each draft's test reads its own row's p(x) and q(x) (equal up to rounding, and q(x) > 0 for
the token its row drew).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from smcspec import sampling
from smcspec.config import MSDConfig, SamplingConfig
from smcspec.decoding import lookup, msd_block, msd_lookup
from smcspec.decoding.agreement import Tally, agreement
from smcspec.decoding.base import (
    Call,
    DecodeResult,
    Drafted,
    MSDStats,
    RoundArgs,
    SharedCaches,
    Step,
    opened,
    pending,
    restart_rows,
    rollback,
)
from smcspec.decoding.logprobs import TokenLogprobs, score, to_host
from smcspec.decoding.residuals import (
    drafted_probs,
    residual,
    residual_scales,
    undrafted,
)
from smcspec.models.base import KVCache


class Round(NamedTuple):
    """One round's outcome: the committed tokens, the depth the walk reached (drafts accepted),
    the drafts committed (fewer after a kept EOS), whether an EOS ended decoding, the row that
    holds the path, the tokens' scores when asked for, and `agreement` at each node the walk
    tested drafts at (those on the committed path with a draft depth: min(len(block), k))."""

    block: list[int]
    depth: int
    kept: int
    done: bool
    winner: int
    scored: TokenLogprobs | None
    agreement: torch.Tensor


class MultiDraftDecoder(Drafted[MSDConfig]):
    def _decode(self, call: Call) -> DecodeResult:
        prompt, s, generator, watch = call
        n = self.config.particles
        with opened(prompt, n, self.target, self.draft) as (clock, seq, caches):
            new: list[int] = []
            walked: list[tuple[int, int]] = []  # per round: (drafts per row, depth reached)
            scores: list[TokenLogprobs] = []
            agreed = Tally()
            accepted = 0
            done = stopped = False
            args = RoundArgs(s, generator, clock, len(prompt))
            while not done and len(new) < s.max_new_tokens:
                k = min(self.config.draft_tokens, s.max_new_tokens - len(new) - 1)
                r = self.round(seq, caches, k, args)
                walked.append((k, r.depth))
                accepted += r.kept
                agreed.add(r.agreement)
                new.extend(r.block)
                done = r.done
                if r.scored is not None:
                    scores.append(r.scored)
                seq = torch.cat([seq, torch.tensor([r.block])], dim=1)
                last = done or len(new) >= s.max_new_tokens
                self.restart(caches, seq.shape[1], None if last else r.winner)
                if not done and watch is not None and watch(new):
                    stopped = done = True
        seconds, split = clock.finish()
        logprobs = TokenLogprobs.join(scores) if s.logprobs is not None else None
        stats = _stats(stopped, accepted, walked, len(new), agreed)
        return DecodeResult(new, len(walked), seconds, split, stats, logprobs=logprobs)

    def step(
        self, seq: torch.Tensor, caches: SharedCaches, remaining: int, args: RoundArgs
    ) -> Step:
        """One round for auto over its shared caches (see `base.Step`), at most `remaining`
        tokens; the caches are left holding the committed text in N rows (the winner's)."""
        n = self.config.particles
        with args.clock.stage("prefill"):
            draft_cache = caches.draft(seq[0])
        pair = (caches.rows(caches.target, n), caches.rows(draft_cache, n))
        k = min(self.config.draft_tokens, remaining - 1)
        r = self.round(seq, pair, k, args)
        caches.restart(seq.shape[1] + len(r.block), n, r.winner)
        return Step(r.block, r.done, r.agreement.numel(), r.kept, r.agreement, r.scored)

    def round(
        self, seq: torch.Tensor, caches: tuple[KVCache, KVCache], k: int, args: RoundArgs
    ) -> Round:
        """One round from seq [1, T] (the prompt, prompt_len tokens, and the text so far), which
        every row of both caches holds; the caller restarts the rows from the winner's after it
        (`restart`)."""
        t_cache, d_cache = caches
        s, generator, clock, prompt_len = args
        seqs = seq.expand(self.config.particles, -1)  # [N, T]: every row holds the same text
        found = self._lookup(seq, k)
        with clock.stage("draft"):
            drafts, logq = self._propose(seqs, d_cache, k, args, found)
        with clock.stage("verify"):
            head = sampling.to_device(pending(seqs, t_cache), drafts.device)
            logits = self.target.forward(torch.cat([head, drafts], 1), t_cache, k + 1)
            logp = sampling.law(logits, s, s.temperature, [seqs, drafts], prompt_len)
            drafts = sampling.to_device(drafts, logp.device)  # a no-op but for k = 0
            logq = sampling.to_device(logq, logp.device)
            u = sampling.uniforms((k * drafts.shape[0] + 1,), generator, logp.device)
            laws = _with_lookup(logq, found)  # the walk's: the lookup's point masses in row 0
            path, depth, winner = self._verify(drafts, laws, logp, u, found)
            scored = () if s.logprobs is None else _score(logp, winner, path, s.logprobs)
            agree = _agreement(logp, logq, winner)  # [k], the draft model's laws
            # The round's one wait for the device, after the K draft steps, the verify pass and
            # the walk are all queued: the block is cut and the rows restarted on the host.
            path, depth, winner, agree, *scored = sampling.to_host(
                path, depth, winner, agree, *scored
            )
        block, kept, done = self._cut(path.tolist(), int(depth), s)
        logprobs = to_host(*(t[: len(block)] for t in scored)) if scored else None
        agree = agree[: min(len(block), k)]
        return Round(block, int(depth), kept, done, int(winner), logprobs, agree)

    def _lookup(self, seq: torch.Tensor, k: int) -> list[int]:
        """The lookup draft's tokens (up to k; [] where it finds none or is not asked for;
        "lookup" and "lookup+draft" alike: the other drafts need the draft model anyway)."""
        if self.config.proposal == "draft":
            return []
        return lookup.continuation(seq[0].tolist(), k, self.config.lookup_ngram)

    def _propose(
        self, seqs: torch.Tensor, cache: KVCache, k: int, args: RoundArgs, found: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """N independent drafts [N, k] and the draft law q at each of their tokens [N, k, V]:
        k batched draft steps. seqs [N, T]: the prompt (prompt_len tokens) and the text. Row 0
        takes the lookup's tokens `found` for its first drafts (the draft model fed them, so
        that its cache holds them and q there is still the model's, for the agreement)."""
        s, generator, _, prompt_len = args
        tokens: list[torch.Tensor] = []  # each [N], on the draft's device
        laws: list[torch.Tensor] = []
        feed = pending(seqs, cache)
        for i in range(k):
            logits = self.draft.forward(feed, cache, 1)[:, -1:]  # [N, 1, V]
            context = [seqs, *(t[:, None] for t in tokens)]
            logq = sampling.law(logits, s, s.proposal_temperature, context, prompt_len)[:, 0]
            x = sampling.sample(logq, generator)  # [N], stays on the device: no sync
            if i < len(found):
                x = x.index_fill(0, torch.zeros(1, dtype=torch.long, device=x.device), found[i])
            tokens.append(x)
            laws.append(logq)
            feed = x[:, None]
        if k == 0:  # no draft step: the empty drafts stay on the host
            rows = seqs.shape[0]
            return torch.zeros(rows, 0, dtype=torch.long), torch.zeros(
                rows, 0, self.draft.vocab_size
            )
        return torch.stack(tokens, dim=1), torch.stack(laws, dim=1)

    def _verify(
        self,
        drafts: torch.Tensor,
        logq: torch.Tensor,
        logp: torch.Tensor,
        u: torch.Tensor,
        found: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`verify`, `msd_block.verify` for the block rule, or `msd_lookup.verify` for a round
        whose first draft is the lookup's (a hook for the broken variants the tests must
        reject)."""
        if found:
            return msd_lookup.verify(drafts, logq, logp, u)
        walk = msd_block.verify if self.config.verify == "block" else verify
        return walk(drafts, logq, logp, u)

    def _cut(self, path: list[int], depth: int, s: SamplingConfig) -> tuple[list[int], int, bool]:
        """The committed block of a walk's path (its first `depth` tokens were accepted drafts,
        the next one drawn), cut after a kept EOS: (block, drafts committed, ended)."""
        eos = self.target.eos_token_ids if s.stop_at_eos else frozenset()
        end = next((i for i, x in enumerate(path[:depth]) if x in eos), None)
        if end is not None:
            return path[: end + 1], end + 1, True
        return path[: depth + 1], depth, path[depth] in eos

    def restart(self, caches: tuple[KVCache, KVCache], seq_len: int, winner: int | None) -> None:
        """Every row restarts from the accepted path, which the winner's rows hold: cropped to
        the committed tokens, then forked N times (by page tables). None: the last round, whose
        rows are only cropped."""
        if winner is None:
            for cache in caches:
                rollback(cache, seq_len)
        else:
            restart_rows(list(caches), seq_len, self.config.particles, winner)


def verify(
    drafts: torch.Tensor, logq: torch.Tensor, logp: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree walk on the device, no host sync. drafts [N, k], logq [N, k, V] (row j's draft
    law at each of its tokens), logp [N, k + 1, V] (the target's after each of its prefixes),
    u [k N + 1]: the test of draft j at depth d takes u[d N + j], the final draw the last.
    Returns the winner's path [k + 1] (its drafts, then at index `depth` the drawn token),
    `depth` [] (drafts accepted) and `winner` [] (a row holding the path).

    Depth by depth, the alive drafts are tested at once and the first that passes is kept: a
    draft preceded by m alive ones is tested only if those m were rejected, so after exactly m
    rejections, against r_m. Only the node's laws [V] are read at each depth (the winner's row
    so far), not all N rows': at a 152k vocabulary these float64 passes are the walk's cost."""
    n, k = drafts.shape
    if k == 0:
        return undrafted(logp, u)
    px, qx = drafted_probs(drafts, logq, logp)  # [N, k] each
    laws = _NodeLaws(logp, logq)
    alive = torch.ones(n, dtype=torch.bool, device=drafts.device)  # [N] drafts on the path
    walking = torch.ones((), dtype=torch.bool, device=drafts.device)
    depth = torch.zeros((), dtype=torch.long, device=drafts.device)
    winner = torch.zeros_like(depth)  # the row of the last kept draft: the node's row
    end_c = torch.zeros((), dtype=torch.float64, device=drafts.device)
    on_host = drafts.device.type == "cpu"
    for d in range(k):
        if on_host and not bool(walking):
            # Reading the flag costs nothing on the CPU, and once the walk has stopped the
            # depths left change nothing: at a 4-token vocabulary they were most of its ops.
            break
        # past the root only the drafts still alive are tested: on the CPU, as many residuals
        m = int(alive.sum()) if on_host else n
        c, total = residual_scales(*laws.at(winner, d), m)  # [m + 1] each
        ahead = alive.long().cumsum(0) - alive.long()  # [N] alive drafts tested before each
        ratio = residual(px[:, d], qx[:, d], c[ahead], total[ahead]) / qx[:, d]  # [N]
        passed = alive & (u[d * n : (d + 1) * n] < ratio)  # [N]
        kept = passed.any()
        first = passed.long().argmax()  # the first that passes (argmax takes the first maximum)
        stop = walking & ~kept  # c after all the alive drafts' rejections: the end residual's
        end_c = torch.where(stop, c.gather(0, alive.long().sum()[None])[0], end_c)
        walking = walking & kept
        alive = alive & (drafts[:, d] == drafts[:, d].gather(0, first[None]))
        depth = depth + walking.long()
        winner = torch.where(walking, first, winner)
    # the end node: the winner's row at `depth`, its residual, or past depth k its bonus law
    end_p, end_q = laws.at(winner, depth)
    rest = (end_p - end_c * end_q).clamp_min(0)  # [V]
    law = torch.where(depth < k, residual(end_p, end_q, end_c, rest.sum()), end_p)
    token = sampling.sample_at(law.log(), u[-1])
    path = torch.cat([drafts.index_select(0, winner[None])[0], token[None]])  # [k + 1]
    path = torch.where(torch.arange(k + 1, device=path.device) == depth, token, path)
    return path, depth, winner


class _NodeLaws:
    """The target's and the draft's laws at one node of the tree, as float64 probabilities."""

    def __init__(self, logp: torch.Tensor, logq: torch.Tensor) -> None:
        n, width, _ = logp.shape  # width = k + 1
        self.k = width - 1
        self.logp = logp.reshape(n * width, -1)  # [N (k + 1), V]
        self.logq = logq.reshape(n * self.k, -1)  # [N k, V]

    def at(self, row: torch.Tensor, depth: torch.Tensor | int) -> tuple[torch.Tensor, ...]:
        """(p, q) [V] each after row's first `depth` drafts (device scalars); past depth k,
        q is the last depth's (unused: there is no draft to test)."""
        at_q = depth.clamp(max=self.k - 1) if torch.is_tensor(depth) else min(depth, self.k - 1)
        p = self.logp.index_select(0, (row * (self.k + 1) + depth)[None])[0]
        q = self.logq.index_select(0, (row * self.k + at_q)[None])[0]
        return p.to(torch.float64).exp_(), q.to(torch.float64).exp_()


def _with_lookup(logq: torch.Tensor, found: Sequence[int]) -> torch.Tensor:
    """logq [N, k, V] with row 0's first len(found) laws the lookup's point masses."""
    if not found:
        return logq
    out = logq.clone()
    masses = lookup.point_masses(list(found), logq.shape[-1])
    out[0, : len(found)] = masses.to(logq.device, logq.dtype, non_blocking=True)
    return out


def _score(
    logp: torch.Tensor, winner: torch.Tensor, path: torch.Tensor, top: int
) -> tuple[torch.Tensor, ...]:
    """`logprobs.score` of the path [k + 1] under the winner's target laws at its positions."""
    return score(logp.index_select(0, winner[None])[0], path, top)


def _agreement(logp: torch.Tensor, logq: torch.Tensor, winner: torch.Tensor) -> torch.Tensor:
    """`agreement` at the winner's k drafted positions [k] (logp [N, k + 1, V], logq [N, k, V]):
    the path's node at depth d is the winner's row there for every d the path reaches, since
    the rows alive at a node share its prefix (so its laws, up to rounding)."""
    k = logq.shape[1]
    at = winner[None]  # a device index: indexing with a tensor scalar would read it on the host
    return agreement(logp.index_select(0, at)[0, :k], logq.index_select(0, at)[0])


def _stats(
    stopped: bool,
    accepted: int,
    walked: list[tuple[int, int]],
    tokens: int,
    agreed: Tally | None = None,
) -> MSDStats:
    """The figures of a decode whose rounds drafted k tokens a row and walked to `depth`, and
    the agreement at the nodes where drafts were tested."""
    agreed = agreed or Tally()
    drafted = max((k for k, _ in walked), default=0)
    by_depth: list[float | None] = []
    for d in range(drafted):
        reached = [depth > d for k, depth in walked if k > d and depth >= d]
        by_depth.append(sum(reached) / len(reached) if reached else None)
    rounds = len(walked)
    return MSDStats(
        stopped=stopped,
        accepted_tokens=accepted,
        accepted_lengths=[depth for _, depth in walked],
        acceptance_by_depth=by_depth,
        mean_accepted_length=sum(d for _, d in walked) / rounds if rounds else None,
        tokens_per_round=tokens / rounds if rounds else None,
        proposed_tokens=agreed.positions,
        draft_agreement=agreed.mean,
        agreement_positions=agreed.positions,
    )
