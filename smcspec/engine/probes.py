"""Profiling a pair on this machine for `engine.costs`: bare passes (`costs.measure`) and real
rounds of every method (`measure_rounds`), once per pair, cached (`profile`)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from smcspec.config import ARConfig, DecodingConfig, MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding.methods import method_row
from smcspec.engine.costs import StepCosts, cache_key, drain, load, measure, save
from smcspec.models.base import CausalLM

# The draft lengths at which `measure_rounds` times real rounds of each drafting method; the
# lengths between are interpolated (a round's time is close to affine in K: K draft steps and a
# pass of K + 1 tokens).
ROUND_KS = (1, 2, 4, 8)
PROBE_PRIOR_ROUNDS = 2


def round_probes(particles: Sequence[int] = (2, 4)) -> list[tuple[str, DecodingConfig]]:
    """ar; sd at ROUND_KS; msd and smc at each N and ROUND_KS."""
    out: list[tuple[str, DecodingConfig]] = [("ar", ARConfig())]
    out += [("sd", SDConfig(draft_tokens=k)) for k in ROUND_KS]
    for n in particles:
        out += [("msd", MSDConfig(particles=n, draft_tokens=k)) for k in ROUND_KS]
        out += [("smc", SMCConfig(particles=n, draft_tokens=k)) for k in ROUND_KS]
    return out


class _Rounds:
    """A watch that stops a decode after `rounds` rounds and keeps the time between its calls:
    each round's wall time but the first's (which holds the prefill)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.calls: list[float] = []

    def __call__(self, _tokens: list[int]) -> bool:
        drain()
        self.calls.append(time.perf_counter())
        return len(self.calls) > self.rounds

    def seconds(self) -> float:
        """The median round: other work on the machine slows a round now and then."""
        return statistics.median(b - a for a, b in zip(self.calls, self.calls[1:], strict=False))


def measure_rounds(
    target: CausalLM,
    draft: CausalLM,
    costs: StepCosts,
    prompt: Sequence[int],
    particles: Sequence[int] = (2, 4),
    rounds: int = 5,
) -> StepCosts:
    """costs with real rounds timed: each of `round_probes` decodes about `rounds` rounds from
    `prompt` (T = 1, no EOS) and its draft, verify and resample stages' seconds per round are
    kept by (method, rows, K) (`rounds_seen`); each method's mean ratio of those to its rounds'
    bare passes is kept as its overhead, for the settings priced by the fits (`shared`). Both
    carry what bare passes leave out: a round's laws, draws and tests over the vocabulary, and
    for msd the tree walk, whose depth is the prompt's (so a real prompt, not noise)."""
    seen: dict[tuple[str, int, int], float] = {}
    tokens: dict[tuple[str, int, int], float] = {}
    ratios: dict[str, list[tuple[float, float]]] = {}
    for name, config in round_probes(particles):
        row = method_row(name)
        k = row.lookahead(config)
        # room for K-token rounds to the end; the watch stops after `rounds` of them
        new_tokens = (rounds + 2) * (k + 1) + 1
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, stop_at_eos=False)
        decoder = row.decoder(target, draft, config, None, None)
        clock = _Rounds(rounds)
        out = decoder.decode(list(prompt), sampling, torch.Generator().manual_seed(0), clock)
        split, count = out.stage_seconds, max(out.rounds, 1)  # every round drafted K
        rows, draft_rows = row.kv_rows(config)
        seen[(name, rows, k)] = clock.seconds()
        a = out.stats.to_dict().get("draft_agreement")
        if k and a is not None and not row.tokens_exact:
            model = row.tokens_per_round(config, a) - 1
            measured = len(out.tokens) / count - 1
            # shrunk toward 1 by PROBE_PRIOR_ROUNDS rounds of the model: a few rounds are noisy
            scale = (measured * count + model * PROBE_PRIOR_ROUNDS) / (
                model * (count + PROBE_PRIOR_ROUNDS)
            )
            tokens[(name, rows, k)] = scale if model > 0 else 1.0
        bare_draft = k * costs.draft(draft_rows)
        draft_more = split["draft"] / count / bare_draft if bare_draft > 0 else 1.0
        target_more = (split["verify"] + split["resample"]) / count / costs.target(rows, k + 1)
        ratios.setdefault(name, []).append((max(1.0, draft_more), max(1.0, target_more)))
    overhead = {
        name: (statistics.fmean(d for d, _ in rs), statistics.fmean(t for _, t in rs))
        for name, rs in ratios.items()
    }
    return replace(costs, rounds_seen=seen, tokens_seen=tokens, overhead=overhead)


# What the measured rounds decode from: an ordinary request, so that the draft agrees with the
# target as it does in use (msd's tree walk goes as deep as that agreement lets it).
PROFILE_PROMPT = "Write a Python function that checks if a number is prime."


def profile_prompt(llm, context: int) -> list[int]:
    """PROFILE_PROMPT through the pair's chat template, or `context` plain ids without a
    tokenizer."""
    if getattr(llm, "tokenizer", None) is None:
        return [i % llm.target.vocab_size for i in range(context)]
    return llm.encode(PROFILE_PROMPT)


def profile(
    llm,
    rows: Sequence[int] = (1, 2, 4, 8),
    max_draft_tokens: int = 8,
    context: int = 128,
    reps: int = 3,
    cache_dir: str | Path | None = None,
    reuse: bool = True,
) -> StepCosts:
    """The pair's step costs on this machine: the cached ones when present (and `reuse`), else
    measured (`measure`) and cached."""
    key = cache_key(llm)
    cached = load(key, cache_dir) if reuse else None
    if cached is not None:
        return cached
    print(
        "smcspec: measuring this machine's step costs for auto (once per model pair)",
        file=sys.stderr,
    )
    costs = measure(llm.target, llm.draft, rows, max_draft_tokens, context, reps, key)
    costs = measure_rounds(llm.target, llm.draft, costs, profile_prompt(llm, context))
    save(costs, cache_dir)
    return costs
