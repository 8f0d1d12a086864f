"""Autoregressive decoding: the target alone, one forward pass per token. The baseline."""

from __future__ import annotations

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig
from smcspec.decoding.base import (
    ARStats,
    Call,
    Decoder,
    DecodeResult,
    RoundArgs,
    SharedCaches,
    Step,
    opened,
    pending,
)
from smcspec.decoding.guide import Guide
from smcspec.decoding.logprobs import TokenLogprobs, score, to_host
from smcspec.models.base import CausalLM, KVCache
from smcspec.potentials import Potential


class AutoregressiveDecoder(Decoder):
    """One token at a time from p, or, with a potential, from the locally shaped law
    p^alpha * mask / norm at each step: local tempering and masking, the naive approach whose
    bias against the sequence-level target SMC removes. At temperature 0 that law is the point
    mass on the likeliest allowed token (`Guide.shaped`). A sequence-level reward has no local
    form, so it is refused here. A step whose shaped law is empty (a dead end) raises
    `ConstraintError`."""

    def __init__(self, target: CausalLM, potential: Potential | None = None) -> None:
        if potential is not None and potential.has_value:
            raise ValueError("a reward needs smc: ar cannot weight whole sequences")
        self.target = target
        self.potential = potential

    def _decode(self, call: Call) -> DecodeResult:
        prompt, sampling_cfg, generator, watch = call
        guide = Guide(self.potential, 1) if self.potential is not None else None
        stopped = False
        scores: list[TokenLogprobs] = []
        with opened(prompt, 1, self.target) as (clock, seq, (cache,)):
            new: list[int] = []
            while len(new) < sampling_cfg.max_new_tokens:
                with clock.stage("verify"):
                    adjusted, logp = self.laws(seq, cache, sampling_cfg, len(prompt))
                law = logp  # [1, V] the target's, which logprobs report
                if guide is not None:  # potentials live on the host
                    greedy = sampling_cfg.temperature == 0  # the law has lost all but its arg-max
                    logp, norm = guide.shaped([0], (adjusted if greedy else logp).cpu(), greedy)
                    if torch.isneginf(norm).all():
                        raise guide.dead_end()
                token, scored = self.draw(logp, law, sampling_cfg.logprobs, generator)
                if scored is not None:
                    scores.append(scored)
                if guide is not None:
                    guide.advance([0], torch.tensor([token]), torch.tensor([True]))
                new.append(token)
                seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
                if sampling_cfg.stop_at_eos and token in self.target.eos_token_ids:
                    break
                if watch is not None and watch(new):
                    stopped = True
                    break
        seconds, split = clock.finish()
        stats = ARStats(stopped)
        if guide is not None:
            stats.complete = (
                bool(new and new[-1] in self.target.eos_token_ids and sampling_cfg.stop_at_eos)
                or guide.end(0) == 0.0
            )
        logprobs = TokenLogprobs.join(scores) if sampling_cfg.logprobs is not None else None
        return DecodeResult(new, len(new), seconds, split, stats, logprobs=logprobs)

    def step(
        self, seq: torch.Tensor, caches: SharedCaches, remaining: int, args: RoundArgs
    ) -> Step:
        """One token for auto over its shared caches (see `base.Step`); no potential (auto runs
        smc for one). The caches are left holding the committed text in one row."""
        if self.potential is not None:
            raise ValueError("ar's step takes no potential")
        s, generator, clock, prompt_len = args
        with clock.stage("verify"):
            _, logp = self.laws(seq, caches.rows(caches.target, 1), s, prompt_len)
        token, scored = self.draw(logp, logp, s.logprobs, generator)
        caches.restart(seq.shape[1] + 1, 1)
        done = s.stop_at_eos and token in self.target.eos_token_ids
        return Step([token], done, 0, 0, torch.zeros(0, dtype=torch.float64), scored)

    def laws(
        self, seq: torch.Tensor, cache: KVCache, s: SamplingConfig, prompt_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's next-token scores after the adjustments (penalties, bias) and its law
        (log-probabilities after temperature and truncation), [1, V] each, at the end of seq
        [1, T] (the prompt, prompt_len tokens, and the text so far)."""
        logits = self.target.forward(pending(seq, cache), cache, 1)[:, -1:]
        adjusted = sampling.scores(logits, s, [seq], prompt_len)[:, 0]
        return adjusted, sampling.tempered(adjusted, s, s.temperature)

    def draw(
        self, logp: torch.Tensor, law: torch.Tensor, top: int | None, generator: torch.Generator
    ) -> tuple[int, TokenLogprobs | None]:
        """The next token, drawn from logp [1, V], and (when `top` asks for them) its
        log-probability under the target's law [1, V] with the top others: read back together,
        the step's one wait for the device."""
        token = sampling.sample(logp, generator)  # [1]
        scored = () if top is None else score(law, sampling.to_device(token, law.device), top)
        token, *scored = sampling.to_host(token, *scored)  # the step's one wait for the device
        return int(token), to_host(*scored) if scored else None
