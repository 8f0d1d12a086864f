"""Prompt lookup (`proposal="lookup"` / `"lookup+draft"`): the n-gram search, and sd with it
sampling the target's law exactly (the independent oracle, Pearson chi-square at ALPHA on R
samples, as test_exactness.py; a 4-token vocabulary makes matches frequent), with the bug of
testing looked-up drafts against the draft model's q rejected."""

from collections import Counter

import pytest
import torch

from smcspec.config import SDConfig
from smcspec.decoding import SpeculativeDecoder
from smcspec.decoding.lookup import continuation, point_masses
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
