"""Prompt lookup (`proposal="lookup"` / `"lookup+draft"`): the n-gram search, and sd with it
sampling the target's law exactly (the independent oracle, Pearson chi-square at ALPHA on R
samples, as test_exactness.py; a 4-token vocabulary makes matches frequent), with the bug of
testing looked-up drafts against the draft model's q rejected."""

import random
from collections import Counter

import pytest
import torch

from smcspec.config import SamplingConfig, SDConfig
from smcspec.decoding import AutoregressiveDecoder, SpeculativeDecoder
from smcspec.decoding.lookup import LookupTally, continuation, point_masses
from tests.decoding.broken import SDLookupWithDraftQ
from tests.decoding.test_exactness import R_BROKEN, SETTINGS, R, longer
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

# A prompt that repeats itself, as a copy-heavy one does: most rounds find a match.
PROMPT = [1, 2, 3, 1]


def draw(decoder, cfg, seed: int, r: int = R) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(decoder.decode(PROMPT, cfg, g).tokens) for _ in range(r))


@pytest.mark.parametrize(
    ("tokens", "k", "ngram", "want"),
    [
        ([1, 2, 3, 9, 1, 2], 2, 3, [3, 9]),  # "1 2" seen before: what followed it
        ([1, 2, 3, 4, 2, 3, 5, 9, 2, 3], 2, 3, [5, 9]),  # the latest occurrence wins
        ([7, 8, 9, 1, 5, 8, 9, 2, 8, 9], 1, 3, [2]),  # latest of "8 9"
        ([4, 5, 6, 7, 5, 6, 4, 5, 6], 3, 3, [7, 5, 6]),  # 3-gram "4 5 6" before 2-gram "5 6"
        ([1, 2, 3], 4, 3, []),  # no earlier occurrence of any suffix
        ([1, 2, 1, 2], 5, 3, [1, 2]),  # cut at the text's end
        ([1, 2, 1], 0, 3, []),
        ([5], 3, 3, []),
        ([1, 1, 1], 2, 1, [1]),  # overlapping occurrences
    ],
)
def test_continuation_takes_the_latest_longest_match(tokens, k, ngram, want):
    assert continuation(tokens, k, ngram) == want


def test_point_masses_put_all_the_mass_on_each_token():
    logq = point_masses([2, 0], 4)
    assert logq.exp().tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    assert point_masses([], 4).shape == (0, 4)


CASES = [
    ("lookup", "token", "plain", 2),
    ("lookup", "token", "penalties and bias", 2),
    ("lookup", "block", "top-p", 3),
    ("lookup+draft", "token", "plain", 3),
]


@pytest.mark.parametrize(("proposal", "verify", "name", "k"), CASES)
def test_sd_with_lookup_is_exact(target, far_draft, proposal, verify, name, k):
    cfg = SETTINGS[name] if k < 3 else longer(SETTINGS[name], k + 1)
    config = SDConfig(k, verify=verify, proposal=proposal, lookup_ngram=2)
    samples = draw(SpeculativeDecoder(target, far_draft, config), cfg, seed=31)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


def test_lookup_drafts_are_really_tested(target, far_draft):
    """The cases above are not plain target steps in disguise: over 200 decodes of 4 new
    tokens, lookup proposes drafts in most of them."""
    cfg = longer(SETTINGS["plain"], 4)
    decoder = SpeculativeDecoder(target, far_draft, SDConfig(3, proposal="lookup"))
    g = torch.Generator().manual_seed(0)
    proposed = [decoder.decode(PROMPT, cfg, g).stats.proposed_tokens for _ in range(200)]
    assert sum(p > 0 for p in proposed) > 150


def test_power_lookup_tested_against_the_draft_models_q_is_caught(target, far_draft):
    cfg = longer(SETTINGS["plain"], 4)
    config = SDConfig(3, proposal="lookup+draft", lookup_ngram=2)
    samples = draw(SDLookupWithDraftQ(target, far_draft, config), cfg, seed=32, r=R_BROKEN)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"lookup_ngram": 0}, "lookup_ngram"),
        ({"proposal": "ngram"}, "proposal"),
        ({"verify": "tree"}, "verify"),
    ],
)
def test_sds_new_settings_are_checked_at_their_bounds(given, field):
    """lookup_ngram >= 1: 1 is taken, 0 refused; proposal and verify name their choices."""
    from smcspec.config import SettingError

    assert SDConfig(lookup_ngram=1, proposal="lookup", verify="block").lookup_ngram == 1
    with pytest.raises(SettingError) as err:
        SDConfig(**given)
    assert err.value.field == field


@pytest.mark.parametrize("half_life", [None, 3.0], ids=["all alike", "recent first"])
def test_the_tally_counts_what_continuation_proposes_at_every_position(half_life):
    """`LookupTally` indexes the n-grams as the text grows instead of rescanning it: the same
    proposals as `continuation` at every position, fed in pieces, on 300 random texts; and its
    estimate reads each depth j from every position whose token i + j is committed, the open
    ones too, each weighed 0.5 ** ((len(text) - i) / half_life). Failed on: an open position
    counted at depths its text has not reached; the counted positions aged from the text's
    end twice (once at counting, once at reading)."""
    for seed in range(300):
        rng = random.Random(seed)
        size, vocab = rng.randint(2, 60), rng.randint(2, 6)
        tokens = [rng.randrange(vocab) for _ in range(size)]
        start, most, ngram = rng.randint(0, size - 1), rng.randint(1, 5), rng.randint(1, 4)
        tally = LookupTally(start=start, most=most, ngram=ngram, half_life=half_life)
        for cut in [*sorted(rng.sample(range(1, size + 1), min(3, size))), size]:
            tally.update(tokens[:cut])
        positions = found = 0
        kept = [0] * most
        for i in range(start, size - most + 1):
            proposed = continuation(tokens[:i], most, ngram)
            positions, found = positions + 1, found + bool(proposed)
            for j, token in enumerate(proposed):
                if token != tokens[i + j]:
                    break
                kept[j] += 1
        assert tally.positions == positions, seed
        if half_life is None:
            assert (tally.found, tally.kept) == (found, kept), seed
        # every depth j from the positions whose token i + j is committed, open ones included
        held, seen = [0.0] * most, [0.0] * most
        proposing = 0.0
        for i in range(start, size):
            w = 1.0 if half_life is None else 0.5 ** ((size - i) / half_life)
            proposed = continuation(tokens[:i], most, ngram)
            proposing += w * bool(proposed)
            for j in range(min(most, size - i)):
                seen[j] += w
                held[j] += w * (proposed[: j + 1] == tokens[i : i + j + 1] and len(proposed) > j)
        for k in range(most + 1):
            want = sum(h / n for h, n in zip(held[:k], seen[:k], strict=True) if n)
            assert tally.drafts_kept(k) == pytest.approx(want), (seed, k)
        assert tally.found_rate == pytest.approx(proposing / seen[0] if seen[0] else 0), seed
        assert tally.measured == max(0, size - start), seed


def test_the_tally_forgets_a_stretch_the_text_no_longer_copies():
    """A text that copies its prompt for 60 tokens, then writes 60 new ones: with recency
    weighing the estimate at the end is near nothing (what a round there keeps), where the
    whole-text mean still prices lookup at ~half the copy's K."""
    prompt = list(range(100, 160))
    text = prompt + prompt + list(range(200, 260))
    recent = LookupTally(start=len(prompt), most=4)
    alike = LookupTally(start=len(prompt), most=4, half_life=None)
    for tally in (recent, alike):
        tally.update(text)
    assert recent.drafts_kept(4) < 0.1
    assert 1.5 < alike.drafts_kept(4) < 2.5
    with pytest.raises(ValueError, match="half_life"):
        LookupTally(start=0, most=4, half_life=0)


def test_a_fresh_tally_has_measured_nothing():
    """Failed on: `drafts_kept` indexing `kept` before the first update sized it."""
    tally = LookupTally(start=5, most=4)
    assert (tally.drafts_kept(4), tally.found_rate, tally.measured) == (0, 0, 0)
    assert not tally.priced


def _tally_estimate(text: list[int], k: int, shift: int = 0) -> float:
    """The tally's kept drafts at the position after PROMPT; shift 1: the plausible bug of
    matching the proposal against the text one position further on."""
    tally = LookupTally(start=len(PROMPT), most=k)
    tally.update(PROMPT + text[shift:] + text[:shift])
    return sum(tally.kept[:k]) / tally.positions  # the one counted position (the others open)


def _mean_and_variance(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)


@pytest.mark.parametrize("shift", [0, 1], ids=["the tally", "the shifted bug"])
def test_the_tally_estimates_the_drafts_a_lookup_round_keeps(target, far_draft, shift):
    """Unbiased, as `LookupTally` argues: at one position, min(match, K) over texts drawn by ar
    has the mean of the drafts sd's first lookup round keeps from the same prompt (4000 each, a
    difference of means within 4 standard errors); the off-by-one bug is more than 4 away."""
    k, r = 3, 4000
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=k, stop_at_eos=False)
    ar, g = AutoregressiveDecoder(target), torch.Generator().manual_seed(41)
    counted = [_tally_estimate(ar.decode(PROMPT, cfg, g).tokens, k, shift) for _ in range(r)]
    sd = SpeculativeDecoder(target, far_draft, SDConfig(k, proposal="lookup"))
    first = SamplingConfig(temperature=1.0, max_new_tokens=k + 1, stop_at_eos=False)
    g = torch.Generator().manual_seed(42)
    kept = [
        sd.decode(PROMPT, first, g, watch=lambda _: True).stats.accepted_tokens for _ in range(r)
    ]
    (a, va), (b, vb) = _mean_and_variance(counted), _mean_and_variance(kept)
    close = abs(a - b) < 4 * (va + vb) ** 0.5
    assert close == (shift == 0), (a, b, (va + vb) ** 0.5)
