"""A draft equal to the target is never wrong: sd and msd accept every draft (acceptance rate
exactly 1) and smc's weights never move (ESS = N after every round, Z-hat = 1), under every
sampling setting, since the draft's law is adjusted and truncated as the target's is.

Exactness cannot see a regression that makes every draft worse (a draft law a little off only
costs speed: sd stays exact, smc's weights correct it); these pins can. With q = p each ratio
p(x) / q(x) is 1 to the last bit (the same logits through the same law), so any rejection or
any weight spread is a bug, however rare: no tolerance is needed beyond float rounding.
A draft 1% too hot (measured) has 4 to 24 of a setting's 2,000 sd drafts rejected, and moves
smc's weights in the first round.

msd's pin also holds its bookkeeping to the walk: every drafted position is accepted, so the
drafts it commits (`accepted_tokens`, counted after a kept EOS too) are the positions it checked
(`proposed_tokens`). Committing one draft too few after a kept EOS breaks it on 48 of 100
"stop at eos" requests.
"""

import pytest
import torch

from smcspec.config import MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding import MultiDraftDecoder, SMCDecoder, SpeculativeDecoder
from smcspec.models.toy import random_lm

PROMPT = [1, 2]
K = 4
# 13 tokens without EOS: rounds of K + 1 = 5, 5, then 3 (the last drafts 2), 10 drafts each
NEW = 13
SETTINGS = {
    "plain": SamplingConfig(1.0, max_new_tokens=NEW, stop_at_eos=False),
    "hot": SamplingConfig(1.6, max_new_tokens=NEW, stop_at_eos=False),
    "cool top-k": SamplingConfig(0.6, top_k=3, max_new_tokens=NEW, stop_at_eos=False),
    "top-p": SamplingConfig(1.0, top_p=0.7, max_new_tokens=NEW, stop_at_eos=False),
    "min-p": SamplingConfig(1.0, min_p=0.2, max_new_tokens=NEW, stop_at_eos=False),
    "greedy": SamplingConfig(0.0, max_new_tokens=NEW, stop_at_eos=False),
    # each draft position is penalized for the drafts before it in the round, as the target's is
    "penalties and bias": SamplingConfig(
        1.0,
        max_new_tokens=NEW,
        stop_at_eos=False,
        repetition_penalty=1.5,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        logit_bias={3: 1.0},
    ),
    # EOS ends requests and particles at different rounds
    "stop at eos": SamplingConfig(0.8, top_p=0.9, max_new_tokens=NEW, frequency_penalty=0.3),
}
REQUESTS = 200


@pytest.fixture(scope="module")
def model():
    return random_lm(16, seed=41, scale=1.5)


def pinned_runs(decoder, model, cfg, seed: int, requests: int) -> list:
    """`requests` decodes, each of which must accept every draft it proposed; the ones that ran
    all their rounds (not ended by an EOS), after checking that most did: the pin has teeth."""
    g = torch.Generator().manual_seed(seed)
    full, proposed = [], 0
    for _ in range(requests):
        out = decoder.decode(PROMPT, cfg, g)
        assert out.stats.accepted_tokens == out.stats.proposed_tokens, out.stats
        proposed += out.stats.proposed_tokens
        if not (cfg.stop_at_eos and out.tokens[-1] in model.eos_token_ids):
            full.append(out)
    assert proposed >= requests * K
    return full


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sd_accepts_every_draft_of_a_draft_equal_to_the_target(model, name):
    decoder = SpeculativeDecoder(model, model, SDConfig(K))
    for out in pinned_runs(decoder, model, SETTINGS[name], seed=0, requests=REQUESTS):
        assert out.rounds == 3 and out.stats.proposed_tokens == 2 * K + 2
        assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("name", list(SETTINGS))
def test_msd_accepts_every_draft_of_a_draft_equal_to_the_target(model, name):
    """N = 3 drafts a round, each accepted: the walk reaches depth K every full round."""
    decoder = MultiDraftDecoder(model, model, MSDConfig(3, K))
    for out in pinned_runs(decoder, model, SETTINGS[name], seed=2, requests=REQUESTS // 2):
        assert out.rounds == 3 and out.stats.proposed_tokens == 2 * K + 2
        assert out.stats.accepted_lengths == [K, K, 2]


# q = p at the plain setting is test_smc.py's test_draft_equal_to_target_keeps_uniform_weights.
@pytest.mark.parametrize("name", [name for name in SETTINGS if name != "plain"])
def test_smc_weights_stay_uniform_with_a_draft_equal_to_the_target(model, name):
    """Threshold 1 resamples at the first weight that moves; none may."""
    cfg = SETTINGS[name]
    n = 8
    decoder = SMCDecoder(model, model, SMCConfig(n, K, 1.0))
    g = torch.Generator().manual_seed(1)
    for _ in range(REQUESTS // n):
        out = decoder.decode(PROMPT, cfg, g)
        assert out.stats.resamples == 0 and out.stats.collapses == 0
        assert out.stats.ess == [pytest.approx(n, rel=1e-12)] * out.rounds
        assert out.stats.weights == [pytest.approx(1 / n, rel=1e-12)] * n
        assert out.stats.log_z_hat == pytest.approx(0.0, abs=1e-12)
