"""The particles of one SMC decode: their tokens, weights and moves (Emara et al. 2026)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smcspec.decoding import particles
from smcspec.decoding.agreement import Tally
from smcspec.decoding.logprobs import ParticleLogprobs


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
    scores: ParticleLogprobs | None = None  # the tokens' log-probabilities, when asked for
    agreed: Tally = field(default_factory=Tally)  # `agreement` at the drafted positions

    @classmethod
    def start(cls, n: int, max_new: int, logprobs: int | None = None) -> Population:
        """N empty particles; `logprobs` (the top alternatives to keep, or None) keeps each
        token's log-probability beside it."""
        return cls(
            tokens=torch.zeros(n, max_new, dtype=torch.long),
            lengths=torch.zeros(n, dtype=torch.long),
            finished=torch.zeros(n, dtype=torch.bool),
            log_w=torch.zeros(n, dtype=torch.float64),
            scores=None if logprobs is None else ParticleLogprobs(n, max_new, logprobs),
        )

    @property
    def live(self) -> torch.Tensor:
        return torch.nonzero(~self.finished).squeeze(1)

    def cut(self) -> torch.Tensor:
        """[N] the particles of nonzero weight that have not ended: before the last factors,
        those that the length limit (or a watch) cut, each a prefix of a valid sequence."""
        return ~self.finished & ~torch.isneginf(self.log_w)

    def common_prefix(self) -> list[int]:
        """The tokens every particle shares, finished ones included: whichever particle is drawn
        at the end starts with them, and resampling only narrows the set, so they only grow."""
        shortest = int(self.lengths.min())
        same = (self.tokens[:, :shortest] == self.tokens[:1, :shortest]).all(dim=0)  # [shortest]
        differ = torch.nonzero(~same)
        agreed = int(differ[0]) if differ.numel() else shortest
        return self.tokens[0, :agreed].tolist()

    def sequence(self, i: int) -> list[int]:
        """Particle i's generated tokens."""
        return self.tokens[i, : self.lengths[i]].tolist()

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

    def extend(
        self,
        block: torch.Tensor,
        kept: torch.Tensor,
        ended: torch.Tensor,
        scored: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """Append block [B, k + 1] to the live particles: row b keeps its first kept[b] tokens
        and is finished where ended[b] (it emitted EOS). scored: the block's `logprobs.score`
        tensors, kept when the population keeps scores."""
        live, g = self.live, self.generated
        if self.scores is not None and scored is not None:
            self.scores.write(live, g, scored)
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
        if self.scores is not None:
            self.scores.reorder(ancestors)
        self.log_w = torch.zeros_like(self.log_w)
        self.resamples += 1

    def finish(self) -> torch.Tensor:
        """Close log Z-hat with the last weights' mean; the normalized weights W [N] (all zero
        when every particle died)."""
        self.log_z += particles.log_mean_weight(self.log_w)
        if torch.isneginf(self.log_w).all():
            return torch.zeros_like(self.log_w)
        return particles.normalize(self.log_w)
