"""Autoregressive decoding: the target alone, one forward pass per token. The baseline."""

from __future__ import annotations

import torch

from smcspec import sampling
from smcspec.config import SamplingConfig
from smcspec.decoding.base import (
    DecodeResult,
    StageClock,
    check_prompt,
    pending,
    released,
    start_cache,
)
from smcspec.models.base import CausalLM


class AutoregressiveDecoder:
    def __init__(self, target: CausalLM) -> None:
        self.target = target

    def decode(
        self, prompt: list[int], sampling_cfg: SamplingConfig, generator: torch.Generator
    ) -> DecodeResult:
        check_prompt(prompt, self.target)
        clock = StageClock()
        seq = torch.tensor([prompt], dtype=torch.long)  # [1, L]
        with released() as held:
            with clock.stage("prefill"):
                cache = start_cache(self.target, seq[0], 1, held)
            new: list[int] = []
            while len(new) < sampling_cfg.max_new_tokens:
                with clock.stage("verify"):
                    logits = self.target.forward(pending(seq, cache), cache, 1)[:, -1]  # [1, V]
                    logp = sampling.log_probs(
                        logits, sampling_cfg.temperature, sampling_cfg.top_k, sampling_cfg.top_p
                    )
                token = int(sampling.sample(logp, generator)[0])
                new.append(token)
                seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
                if sampling_cfg.stop_at_eos and token in self.target.eos_token_ids:
                    break
        seconds, split = clock.finish()
        return DecodeResult(tokens=new, rounds=len(new), seconds=seconds, stage_seconds=split)
