import math
from collections import Counter

import pytest
import torch

from smcspec import sampling
from tests.stats import ALPHA, chi_square_pvalue

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])


def probs(logp: torch.Tensor) -> list[float]:
    return [round(float(v), 6) for v in logp.exp()]


def test_temperature_scales_logits():
    got = sampling.log_probs(LOGITS, temperature=2.0)
    want = torch.log_softmax(LOGITS / 2.0, dim=-1)
    torch.testing.assert_close(got, want)


def test_greedy_puts_all_mass_on_argmax():
    assert probs(sampling.log_probs(LOGITS, temperature=0.0)) == [1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_k_tokens_renormalized():
    p = sampling.log_probs(LOGITS, 1.0, top_k=2).exp()
    e = math.e
    assert p[2] == 0 and p[3] == 0
    assert float(p[0]) == pytest.approx(e / (e + 1))


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    base = torch.softmax(LOGITS, -1)  # 0.644, 0.237, 0.087, 0.032
    p = sampling.log_probs(LOGITS, 1.0, top_p=0.7).exp()
    assert p[2] == 0 and p[3] == 0  # 0.644 < 0.7, so token 1 is needed; 0.881 >= 0.7 stops
    assert float(p[0]) == pytest.approx(float(base[0] / (base[0] + base[1])))
    only_first = sampling.log_probs(LOGITS, 1.0, top_p=0.5)
    assert probs(only_first) == [1.0, 0.0, 0.0, 0.0]


def test_a_vanishing_top_p_still_keeps_the_most_likely_token():
    """5e-324 rounds to 0 in float32; nothing was kept and the law was NaN (server fuzzing)."""
    for top_p in (5e-324, 1e-40, 1e-9):
        assert probs(sampling.log_probs(LOGITS, 1.0, top_p=top_p)) == [1.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_on_renormalized_mass():
    # after top-k=3 the masses are 0.665, 0.245, 0.090: 0.91 is already >= 0.9, not >= 0.92
    two = sampling.log_probs(LOGITS, 1.0, top_k=3, top_p=0.9).exp()
    assert (two[:2] > 0).all() and two[2] == 0 and two[3] == 0
    three = sampling.log_probs(LOGITS, 1.0, top_k=3, top_p=0.92).exp()
    assert (three[:3] > 0).all() and three[3] == 0


def test_sample_matches_the_law():
    logp = sampling.log_probs(LOGITS, 1.0)
    g = torch.Generator().manual_seed(0)
    draws = sampling.sample(logp.expand(20000, -1), g)
    law = {i: float(v) for i, v in enumerate(logp.exp())}
    assert chi_square_pvalue(Counter(draws.tolist()), law) > ALPHA


def test_sample_never_picks_masked_tokens():
    logp = sampling.log_probs(LOGITS, 1.0, top_k=1)
    g = torch.Generator().manual_seed(1)
    assert set(sampling.sample(logp.expand(1000, -1), g).tolist()) == {0}


def test_power_check_rejects_a_wrong_law():
    g = torch.Generator().manual_seed(0)
    draws = sampling.sample(sampling.log_probs(LOGITS, 1.3).expand(20000, -1), g)
    law = {i: float(v) for i, v in enumerate(sampling.log_probs(LOGITS, 1.0).exp())}
    assert chi_square_pvalue(Counter(draws.tolist()), law) < ALPHA


# Temperatures whose scaled logits overflow (or whose float32 value is 0 or denormal), huge ones,
# and logits at the float limits: the law must stay a law and every draw a token of the vocabulary.
EXTREME_TEMPERATURES = [1e-45, 1e-38, 1.4e-45, 1.1754944e-38, 1e-300, 1e30, 1e38]
EXTREME_LOGITS = [
    LOGITS,
    torch.tensor([3e38, -3e38, 1.0, 0.0]),
    torch.tensor([float("inf"), 0.0, float("inf"), -1.0]),
    torch.tensor([float("-inf"), 2.0, float("-inf"), 1.0]),
    torch.tensor([float("nan"), 1.0, 0.0, -1.0]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", EXTREME_TEMPERATURES)
@pytest.mark.parametrize("top_k", [0, 2])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 5e-324])
def test_extreme_settings_give_a_law_and_tokens_in_the_vocabulary(dtype, temperature, top_k, top_p):
    """1e-45 overflowed float32's scaled logits to inf; the law was NaN and `sample` returned
    id 4 == V, which then failed a whole server batch (issue 12)."""
    g = torch.Generator().manual_seed(0)
    for logits in EXTREME_LOGITS:
        logp = sampling.log_probs(logits.to(dtype), temperature, top_k, top_p)
        assert not logp.isnan().any() and not logp.isposinf().any()
        assert float(torch.logsumexp(logp.double(), -1)) == pytest.approx(0.0, abs=1e-6)
        draws = sampling.sample(logp.expand(200, -1), g)
        assert draws.min() >= 0 and draws.max() < logits.shape[-1]
        assert bool(logp[draws].isfinite().all())  # only tokens of positive probability


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-300])
def test_an_overflowing_temperature_is_the_greedy_law(temperature):
    """Scaled logits overflow only when T < |l| / 3.4e38; two distinct float32 logits are then
    more than 1e31 apart once scaled, so every other token's tempered mass is exp(-1e31) = 0."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0], [1.0, 1.0 + 1e-6, 0.0, 0.0]])
    greedy = sampling.log_probs(logits, 0.0)
    torch.testing.assert_close(sampling.log_probs(logits, temperature).exp(), greedy.exp())
    mixed = torch.stack([logits[0], logits[0] * 1e-40])  # 1e-40: no overflow at T = 1e-45
    want = torch.log_softmax(logits[0] * 1e-40 / 1e-45, -1)  # float32: 1e-45 is 1.4e-45
    torch.testing.assert_close(sampling.log_probs(mixed, 1e-45)[1], want)


def test_sample_stays_in_the_vocabulary_on_a_row_without_mass():
    """All -inf (a row whose mask allows nothing) or NaN: no token to draw, yet an id in range."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([[NEG] * 4, [float("nan")] * 4, [NEG, NEG, 0.0, NEG]])
    got = sampling.sample(rows, g)
    assert got.tolist()[2] == 2 and got.min() >= 0 and got.max() < 4


NEG = float("-inf")


def test_min_p_keeps_the_tokens_within_a_fraction_of_the_likeliest():
    """Hugging Face's min-p: keep p_i >= min_p * max p (after temperature), renormalize."""
    p = torch.softmax(LOGITS / 0.8, -1)
    for min_p in (0.1, 0.3, 0.5, 1.0):
        keep = p >= min_p * p.max()
        want = torch.where(keep, p / p[keep].sum(), torch.zeros_like(p))
        got = sampling.log_probs(LOGITS, 0.8, min_p=min_p).exp()
        torch.testing.assert_close(got, want)
    assert probs(sampling.log_probs(LOGITS, 0.8, min_p=0.0)) == probs(torch.log(p))


def reference_adjust(logits: list[float], context: list[int], prompt_len: int, cfg) -> list[float]:
    """The adjustments one token at a time, in float64, from their definitions."""
    out = []
    generated = context[prompt_len:]
    for token, value in enumerate(logits):
        value += dict(cfg.logit_bias).get(token, 0.0)
        if token in context:
            r = cfg.repetition_penalty
            value = value / r if value > 0 else value * r
        count = generated.count(token)
        value -= cfg.frequency_penalty * count + cfg.presence_penalty * (count > 0)
        out.append(value)
    return out


def test_adjust_follows_the_definitions_at_every_position_of_a_block():
    """Two rows, a block of three positions: position j follows the prompt, the text and the
    block's first j tokens (repetition over all of them, presence / frequency over the text)."""
    from smcspec.config import SamplingConfig

    cfg = SamplingConfig(
        repetition_penalty=1.7,
        presence_penalty=0.6,
        frequency_penalty=0.3,
        logit_bias={"2": -1.25, 4: 3.0},
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64) * 2
    tokens = torch.tensor([[1, 5, 2, 2, 3, 0], [4, 4, 0, 1, 1, 1]])  # prompt 2, text 2, drafts 2
    got = sampling.adjust(logits, tokens, 2, cfg)
    for b in range(2):
        for j in range(3):
            context = tokens[b, : 4 + j].tolist()
            want = reference_adjust(logits[b, j].tolist(), context, 2, cfg)
            torch.testing.assert_close(got[b, j], torch.tensor(want, dtype=torch.float64))
    assert sampling.adjust(logits, tokens, 2, SamplingConfig()) is logits  # nothing to do


def test_a_bias_outside_the_vocabulary_is_refused():
    from smcspec.config import SamplingConfig

    with pytest.raises(ValueError, match="token 9 is outside the vocabulary"):
        sampling.adjust(
            torch.zeros(1, 1, 4), torch.tensor([[1]]), 1, SamplingConfig(logit_bias={9: 1})
        )
