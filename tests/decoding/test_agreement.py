"""The draft agreement each drafting method reports, a = sum_x min(p(x), q(x)) averaged over
the positions it drafted, against the same mean computed here from the toy models' logits.

Which positions a round drafted is read off the draft model itself: a spy on its forward keeps
every draft step's context (each row's prefix, whose law the step drew from), so the decoder is
not trusted to say where it drafted. Of those, each method counts:
- sd: the drafts checked, up to and including a round's first rejection. Their contexts are the
  proper prefixes of the output: a later draft follows the rejected one, which the residual draw
  never repeats, and a draft after a kept EOS follows the whole output.
- msd: the tree's nodes on the committed path (where drafts were tested), each once, though
  every row alive there drafted from it: again the proper prefixes of the output.
- smc: every live particle's drafts up to and including its first EOS of the round: the contexts
  with no EOS in the generated part.
The laws are computed here from the definitions (temperature, then top-k), not by `sampling`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from smcspec.config import MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding import MultiDraftDecoder, SMCDecoder, SpeculativeDecoder
from smcspec.models.toy import ToyCache, ToyLM

PROMPT = [1, 2]  # two tokens: the draft's prefill is a forward too, which the spy leaves out
EOS = 0
SETTINGS = SamplingConfig(temperature=0.8, top_k=3, draft_temperature=1.3, max_new_tokens=60)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=60)


class DraftSpy:
    """A draft model that keeps every draft step's contexts: `steps[i][r]`, row r's prefix at
    the i-th step (the prefill, which drafts nothing, left out)."""

    def __init__(self, model: ToyLM) -> None:
        self.model = model
        self.steps: list[list[tuple[int, ...]]] = []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def forward(self, tokens: torch.Tensor, cache: ToyCache, num_logits: int) -> torch.Tensor:
        logits = self.model.forward(tokens, cache, num_logits)
        if len(cache.rows[0]) >= len(PROMPT):
            self.steps.append(list(cache.rows))
        return logits


def law(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top_k largest (all when 0); the arg-max's point mass at 0."""
    logits = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    z = logits / temperature
    if top_k:
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    return z.softmax(-1)


def agreement_at(target: ToyLM, draft: ToyLM, context: tuple[int, ...], s: SamplingConfig):
    p = law(target.logits(context), s.temperature, s.top_k)
    q = law(draft.logits(context), s.proposal_temperature, s.top_k)
    return float(torch.minimum(p, q).sum())


def drafted(
    method: str, spy: DraftSpy, output: list[int], s: SamplingConfig
) -> list[tuple[int, ...]]:
    """The contexts of the positions `method` counts (see the module docstring)."""
    text = tuple(PROMPT + output)
    contexts = [c for step in spy.steps for c in step]
    if method == "smc":
        return [c for c in contexts if not (s.stop_at_eos and EOS in c[len(PROMPT) :])]
    proper = [c for c in contexts if len(c) < len(text) and text[: len(c)] == c]
    return sorted(set(proper)) if method == "msd" else proper


def decode(method: str, target: ToyLM, draft: ToyLM, s: SamplingConfig, seed: int = 0):
    spy = DraftSpy(draft)
    decoder = {
        "sd": lambda: SpeculativeDecoder(target, spy, SDConfig(4)),
        "msd": lambda: MultiDraftDecoder(target, spy, MSDConfig(particles=3, draft_tokens=3)),
        "smc": lambda: SMCDecoder(target, spy, SMCConfig(particles=4, draft_tokens=3)),
    }[method]()
    result = decoder.decode(PROMPT, s, torch.Generator().manual_seed(seed))
    return result, drafted(method, spy, result.tokens, s)


@pytest.mark.parametrize("stop_at_eos", [True, False], ids=["eos", "no-eos"])
@pytest.mark.parametrize("method", ["sd", "msd", "smc"])
def test_the_reported_mean_is_sum_min_p_q_over_the_drafted_positions(
    method, stop_at_eos, target, far_draft
):
    """Ten seeds: with EOS at 1 in 4 tokens a decode is short, and its last round is where a
    kept EOS cuts the positions counted."""
    s = dataclasses.replace(SETTINGS, stop_at_eos=stop_at_eos)
    positions = 0
    for seed in range(10):
        result, contexts = decode(method, target, far_draft, s, seed)
        expected = [agreement_at(target, far_draft, c, s) for c in contexts]
        stats = result.stats
        assert stats.agreement_positions == len(expected) > 0
        assert stats.draft_agreement == pytest.approx(sum(expected) / len(expected), rel=1e-6)
        if method != "smc":  # the positions counted are those whose drafts were checked
            assert stats.proposed_tokens == stats.agreement_positions
        diagnostics = stats.to_dict()
        assert diagnostics["draft_agreement"] == stats.draft_agreement
        assert diagnostics["agreement_positions"] == stats.agreement_positions
        positions += len(expected)
    assert positions > 30


@pytest.mark.parametrize("method", ["sd", "msd", "smc"])
def test_a_near_draft_agrees_more_than_a_far_one(method, target, near_draft, far_draft):
    near, _ = decode(method, target, near_draft, SETTINGS)
    far, _ = decode(method, target, far_draft, SETTINGS)
    assert 0 < far.stats.draft_agreement < near.stats.draft_agreement <= 1


@pytest.mark.parametrize("method", ["sd", "msd", "smc"])
def test_greedy_agreement_is_one_where_the_argmaxes_agree(method, target, far_draft):
    itself, _ = decode(method, target, target, GREEDY)
    assert itself.stats.draft_agreement == 1.0
    far, contexts = decode(method, target, far_draft, GREEDY)
    agree = [int(target.logits(c).argmax() == far_draft.logits(c).argmax()) for c in contexts]
    assert 0 < sum(agree) < len(agree) == far.stats.agreement_positions
    assert far.stats.draft_agreement == pytest.approx(sum(agree) / len(agree), rel=1e-9)


def test_nothing_drafted_reports_no_agreement(target, far_draft):
    one = SamplingConfig(temperature=0.8, max_new_tokens=1)
    for method in ("sd", "msd", "smc"):
        stats = decode(method, target, far_draft, one)[0].stats
        assert (stats.draft_agreement, stats.agreement_positions) == (None, 0), method
