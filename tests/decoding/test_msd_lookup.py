"""msd with a lookup draft (`MSDConfig(proposal="lookup+draft")`): its first draft the text's
own continuation (a point mass), the others the draft model's, walked with each draft's law
(`msd_lookup`). Exactness in the suite's style (the independent oracle, Pearson chi-square at
ALPHA on R samples, a prompt that repeats itself so that most rounds find a match), the walk
held to SpecInfer's loop one test at a time, and the bug of testing the looked-up tokens with
the draft model's q rejected."""

import pytest
import torch

from smcspec.config import MSDConfig, SamplingConfig
from smcspec.decoding import AutoregressiveDecoder, MultiDraftDecoder, msd_lookup
from tests.decoding import broken
from tests.decoding.test_exactness import R_BROKEN, SETTINGS, longer
from tests.decoding.test_lookup import PROMPT, draw
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

LOOKUP = {"proposal": "lookup+draft", "lookup_ngram": 2}
# (N, K, settings, msd's other settings): K in {1, 2, 4}, N in {2, 4}, each under a setting
# that changes the tests (the lookup's context holds its own drafts: penalties count them);
# "lookup" is "lookup+draft" for msd, and with the block rule a round without a lookup draft
# is verified by it
CASES = [
    (2, 1, "cool top-k", LOOKUP),
    (2, 2, "penalties and bias", {"proposal": "lookup", "verify": "block", "lookup_ngram": 2}),
    (4, 4, "draft at its own temperature", LOOKUP),
]


def _settings(name: str, k: int) -> SamplingConfig:
    return SETTINGS[name] if k < 3 else longer(SETTINGS[name], k + 1)


@pytest.mark.parametrize(("n", "k", "name", "given"), CASES)
def test_msd_with_a_lookup_draft_is_exact(target, far_draft, n, k, name, given):
    cfg = _settings(name, k)
    decoder = MultiDraftDecoder(target, far_draft, MSDConfig(n, k, **given))
    samples = draw(decoder, cfg, seed=41)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


def test_the_lookup_draft_is_really_proposed(target, far_draft, monkeypatch):
    """The cases above are not msd without a lookup in disguise: most rounds find one."""
    decoder = MultiDraftDecoder(target, far_draft, MSDConfig(2, 2, **LOOKUP))
    found = []
    lookup = decoder._lookup
    monkeypatch.setattr(
        decoder, "_lookup", lambda seq, k: found.append(lookup(seq, k)) or found[-1]
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        decoder.decode(PROMPT, _settings("plain", 2), g)
    assert sum(bool(f) for f in found) > 0.75 * len(found)


@pytest.mark.parametrize("n", [1, 3])
def test_the_walk_is_the_plain_loop(target, far_draft, n):
    """Same seed, same uniforms: `msd_lookup.verify` commits what SpecInfer's loop with each
    draft's own law commits (`broken.tree_walk`, fed the same point masses)."""
    cfg = SamplingConfig(1.0, draft_temperature=1.5, max_new_tokens=7)
    fast = MultiDraftDecoder(target, far_draft, MSDConfig(n, 3, **LOOKUP))
    plain = broken.MSDReference(target, far_draft, MSDConfig(n, 3, **LOOKUP))
    for seed in range(40):
        a = fast.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        b = plain.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens and a.stats == b.stats, seed


def test_without_a_point_mass_the_walk_is_msds(target, far_draft):
    """Where every draft is the model's, the walk one test at a time commits what msd's walk in
    closed form commits, seed for seed."""

    class OneTestAtATime(MultiDraftDecoder):
        def _verify(self, drafts, logq, logp, u, found=()):
            return msd_lookup.verify(drafts, logq, logp, u)

    cfg = SamplingConfig(1.0, top_p=0.9, max_new_tokens=7)
    for n, k in [(2, 2), (4, 3)]:
        a, b = (
            cls(target, far_draft, MSDConfig(n, k)) for cls in (MultiDraftDecoder, OneTestAtATime)
        )
        for seed in range(30):
            g, h = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            assert a.decode(PROMPT, cfg, g).tokens == b.decode(PROMPT, cfg, h).tokens, seed


def test_power_the_lookup_tested_with_the_draft_models_q_is_caught(target, far_draft):
    cfg = _settings("plain", 3)
    decoder = broken.MSDLookupWithDraftQ(target, far_draft, MSDConfig(2, 3, **LOOKUP))
    samples = draw(decoder, cfg, seed=42, r=R_BROKEN)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


def test_greedy_msd_with_a_lookup_equals_greedy_ar(target, far_draft):
    cfg = SamplingConfig(0.0, max_new_tokens=8, stop_at_eos=False)
    want = AutoregressiveDecoder(target).decode(PROMPT, cfg, torch.Generator()).tokens
    got = MultiDraftDecoder(target, far_draft, MSDConfig(3, 3, **LOOKUP)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(1)
    )
    assert got.tokens == want
