"""Profiling a pair on this machine for `engine.costs`: bare passes (`timing.measure`) and real
rounds of every method (`measure_rounds`), once per pair, cached (`profile`)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from smcspec.config import DecodingConfig, SamplingConfig
from smcspec.decoding.base import DecodeResult
from smcspec.decoding.methods import Grid, candidates, method_row
from smcspec.engine.cost_cache import cache_key, load, save
from smcspec.engine.costs import StepCosts
from smcspec.engine.timing import drain, measure
from smcspec.models.base import CausalLM

# The draft lengths at which `measure_rounds` times real rounds of each drafting method; the
# lengths between are interpolated (a round's time is close to affine in K: K draft steps and a
# pass of K + 1 tokens).
ROUND_KS = (1, 2, 4, 8)
PROBE_PRIOR_ROUNDS = 2


def round_probes(particles: Sequence[int] = (2, 4)) -> list[tuple[str, DecodingConfig]]:
    """Every setting auto may weigh (exact or not) at ROUND_KS, and each N of `particles`."""
    ns = tuple(particles)
    return candidates(Grid(ROUND_KS, msd_particles=ns, smc_particles=ns), exact=False)


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

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.calls, self.calls[1:], strict=False)]


def measure_rounds(
    target: CausalLM,
    draft: CausalLM,
    costs: StepCosts,
    prompt: Sequence[int],
    particles: Sequence[int] = (2, 4),
    rounds: int = 3,
    passes: int = 2,
) -> StepCosts:
    """costs with real rounds timed: each of `round_probes` decodes about `rounds` rounds from
    `prompt` (T = 1, no EOS), once in each of `passes` passes over all of them (interleaved: a
    slow spell of the machine then falls on every setting, not on one setting's rounds; the
    default pair's passes drift by 20% between spells here). The median of a setting's rounds
    is kept by (method, rows, K) (`rounds_seen`), and each method's mean ratio of its draft,
    verify and resample stages' seconds to its rounds' bare passes as its overhead, for the
    settings priced by the fits (`shared`). Both carry what bare passes leave out: a round's
    laws, draws and tests over the vocabulary, and for msd the tree walk, whose depth is the
    prompt's (so a real prompt, not noise)."""
    probes = round_probes(particles)
    tallies = [_Tally() for _ in probes]
    for p in range(passes):
        for (name, config), tally in zip(probes, tallies, strict=True):
            tally.add(*_probe(target, draft, name, config, prompt, rounds, seed=p))
    seen: dict[tuple[str, int, int], float] = {}
    tokens: dict[tuple[str, int, int], float] = {}
    ratios: dict[str, list[tuple[float, float]]] = {}
    for (name, config), tally in zip(probes, tallies, strict=True):
        row = method_row(name)
        k = row.lookahead(config)
        rows, draft_rows = row.kv_rows(config)
        seen[(name, rows, k)] = statistics.median(tally.gaps)
        count = max(tally.rounds, 1)  # every round drafted K
        if k and tally.positions and not row.tokens_exact:
            model = row.tokens_per_round(config, tally.agreement / tally.positions) - 1
            measured = tally.tokens / count - 1
            # shrunk toward 1 by PROBE_PRIOR_ROUNDS rounds of the model: a few rounds are noisy
            scale = (measured * count + model * PROBE_PRIOR_ROUNDS) / (
                model * (count + PROBE_PRIOR_ROUNDS)
            )
            tokens[(name, rows, k)] = scale if model > 0 else 1.0
        bare_draft = k * costs.draft(draft_rows)
        draft_more = tally.draft / count / bare_draft if bare_draft > 0 else 1.0
        target_more = tally.target / count / costs.target(rows, k + 1)
        ratios.setdefault(name, []).append((max(1.0, draft_more), max(1.0, target_more)))
    overhead = {
        name: (statistics.fmean(d for d, _ in rs), statistics.fmean(t for _, t in rs))
        for name, rs in ratios.items()
    }
    return replace(costs, rounds_seen=seen, tokens_seen=tokens, overhead=overhead)


@dataclass
class _Tally:
    """One probe's passes summed: its rounds' gaps, rounds, tokens, stage seconds and the
    agreement it measured (a sum over drafted positions)."""

    gaps: list[float] = field(default_factory=list)
    rounds: int = 0
    tokens: int = 0
    draft: float = 0.0
    target: float = 0.0
    agreement: float = 0.0
    positions: int = 0

    def add(self, out: DecodeResult, gaps: list[float]) -> None:
        self.gaps += gaps
        self.rounds += out.rounds
        self.tokens += len(out.tokens)
        split = out.stage_seconds
        self.draft += split["draft"]
        self.target += split["verify"] + split["resample"]
        stats = out.stats.to_dict()
        a, n = stats.get("draft_agreement"), stats.get("agreement_positions")
        if a is not None and n:
            self.agreement += a * n
            self.positions += n


def _probe(
    target: CausalLM,
    draft: CausalLM,
    name: str,
    config: DecodingConfig,
    prompt: Sequence[int],
    rounds: int,
    seed: int,
) -> tuple[DecodeResult, list[float]]:
    """One decode of `rounds` rounds (and the first, which holds the prefill) of a setting:
    its result and the seconds between its rounds."""
    row = method_row(name)
    k = row.lookahead(config)
    # room for K-token rounds to the end; the watch stops after `rounds` of them
    new_tokens = (rounds + 2) * (k + 1) + 1
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, stop_at_eos=False)
    decoder = row.decoder(target, draft, config, None, None)
    clock = _Rounds(rounds)
    out = decoder.decode(list(prompt), sampling, torch.Generator().manual_seed(seed), clock)
    return out, clock.gaps()


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
    start = time.perf_counter()
    costs = measure(llm.target, llm.draft, rows, max_draft_tokens, context, reps, key)
    costs = measure_rounds(llm.target, llm.draft, costs, profile_prompt(llm, context))
    save(costs, cache_dir)
    print(
        f"smcspec: step costs measured in {time.perf_counter() - start:.1f} s (start-up, not "
        "decoding: later runs read them from the cache)",
        file=sys.stderr,
    )
    return costs
