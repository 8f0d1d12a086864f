"""`sampling.law` against the reference law of tests/oracle.py, and each sampling field on its
own: it changes the law where its definition says, and nowhere else.

The fields are read on one fixed context: a prompt (1, 2, 6) and a text (3, 3, 5, 2), so that
token 3 was generated twice, 5 and 2 once (2 also in the prompt), 1 and 6 only in the prompt,
and 0, 4, 7 never. Token 0 is never touched by any adjustment: log-odds against it show each
token's own change.
"""

import itertools
import math

import pytest
import torch

from smcspec import sampling
from smcspec.config import SamplingConfig
from tests import oracle

PROMPT = [1, 2, 6]
TEXT = [3, 3, 5, 2]
CONTEXT = PROMPT + TEXT
# positive and negative logits among the seen tokens, so both sides of the repetition penalty
LOGITS = [1.2, -0.7, 2.0, 0.4, -1.5, 0.9, -0.3, 0.1]
PLAIN = SamplingConfig(temperature=1.0)
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _small_tensors_on_one_thread(one_torch_thread):
    """Thousands of laws of a dozen tokens (see tests/conftest.py `one_torch_thread`)."""


def fast_law(cfg: SamplingConfig, logits: list[float] = LOGITS) -> list[float]:
    """`sampling.law` at the position after CONTEXT, in float64."""
    x = torch.tensor(logits, dtype=torch.float64)[None, None]  # [1, 1, V]
    context = torch.tensor([CONTEXT])
    return sampling.law(x, cfg, cfg.temperature, [context], len(PROMPT))[0, 0].tolist()


def reference_law(cfg: SamplingConfig, logits: list[float] = LOGITS) -> list[float]:
    return oracle.next_token_law(logits, CONTEXT, len(PROMPT), cfg)


def assert_same_law(got: list[float], want: list[float], tol: float = 1e-12) -> None:
    assert [v == NEG_INF for v in got] == [v == NEG_INF for v in want], (got, want)
    for a, b in zip(got, want, strict=True):
        assert a == NEG_INF or abs(a - b) <= tol, (got, want)


def support(logp: list[float]) -> set[int]:
    return {i for i, v in enumerate(logp) if v > NEG_INF}


def log_odds_change(law: list[float], base: list[float], ref: int = 0) -> list[float]:
    """(log p_i - log p_ref) - (log base_i - log base_ref): token i's own change, whatever the
    renormalization did."""
    return [(a - law[ref]) - (b - base[ref]) for a, b in zip(law, base, strict=True)]


def assert_odds_kept(law: list[float], base: list[float]) -> None:
    """The survivors of a truncation keep the odds they had before it."""
    ref = max(support(law), key=lambda i: law[i])
    for i in support(law):
        assert (law[i] - law[ref]) - (base[i] - base[ref]) == pytest.approx(0.0, abs=1e-12)


# -- the fast path against the reference --------------------------------------------------------

ADJUSTMENTS = {
    "none": {},
    "bias": {"logit_bias": {3: 1.5, 9: -2.0}},
    "repetition": {"repetition_penalty": 1.6},
    "presence": {"presence_penalty": 0.9},
    "frequency": {"frequency_penalty": -0.7},
    "all": {
        "logit_bias": {0: -1.0, 5: 0.5},
        "repetition_penalty": 0.8,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.6,
    },
}
GRID = list(itertools.product([0.0, 0.6, 1.0, 1.8], [0, 1, 4], [1.0, 0.85, 0.4], [0.0, 0.05, 0.4]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adjustment", list(ADJUSTMENTS))
def test_law_agrees_with_the_reference_on_random_logits(adjustment, dtype):
    """Every (temperature, top_k, top_p, min_p) of GRID with each adjustment, at every position
    of a three-token block of two rows, each row its own context. float64 must agree to
    rounding; float32 (what the models give) to its own precision, on the same support."""
    g = torch.Generator().manual_seed(7)
    vocab, block, prompt_len = 12, 3, 3
    logits = (torch.randn(2, block, vocab, generator=g, dtype=torch.float64) * 2).to(dtype)
    tokens = torch.tensor([[1, 2, 9, 3, 3, 11, 3, 0], [4, 4, 5, 6, 5, 10, 2, 10]])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for temperature, top_k, top_p, min_p in GRID:
        cfg = SamplingConfig(temperature, top_k, top_p, min_p=min_p, **ADJUSTMENTS[adjustment])
        got = sampling.law(logits, cfg, temperature, [tokens], prompt_len)  # [2, 3, V]
        for b, j in itertools.product(range(2), range(block)):
            context = tokens[b, : tokens.shape[1] - block + 1 + j].tolist()
            want = oracle.next_token_law(logits[b, j].tolist(), context, prompt_len, cfg)
            assert_same_law(got[b, j].double().tolist(), want, tol)


# -- one field at a time ------------------------------------------------------------------------


def test_temperature_divides_every_log_odds_and_keeps_the_support():
    plain, hot = fast_law(PLAIN), fast_law(SamplingConfig(2.5))
    assert_same_law(hot, reference_law(SamplingConfig(2.5)))
    assert support(hot) == set(range(len(LOGITS)))
    for i, change in enumerate(log_odds_change(hot, plain)):
        want = (LOGITS[i] - LOGITS[0]) * (1 / 2.5 - 1)
        assert change == pytest.approx(want, abs=1e-12)
    assert max(abs(c) for c in log_odds_change(hot, plain)) > 0.5


def test_temperature_zero_is_the_first_arg_max():
    greedy = SamplingConfig(0.0, top_k=3, top_p=0.5)  # truncation is moot at T = 0
    assert fast_law(greedy) == [NEG_INF, NEG_INF, 0.0] + [NEG_INF] * 5
    tied = [0.5, 2.0, -1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    assert fast_law(greedy, tied) == reference_law(greedy, tied)
    assert support(fast_law(greedy, tied)) == {1}


def test_top_k_keeps_the_k_likeliest_at_their_odds():
    cfg = SamplingConfig(1.0, top_k=3)
    plain, law = fast_law(PLAIN), fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    assert support(law) == {2, 0, 5}  # logits 2.0, 1.2, 0.9
    assert_odds_kept(law, plain)
    for off in (0, len(LOGITS)):
        assert_same_law(fast_law(SamplingConfig(1.0, top_k=off)), plain)


def test_top_k_keeps_exactly_k_under_ties():
    """Three tokens tie for second place and k = 2: one of them stays (which one, sampling does
    not promise), at the mass the best has."""
    tied = [3.0, 1.0, 1.0, 1.0, 0.0, -1.0, 0.5, 0.2]
    law = fast_law(SamplingConfig(1.0, top_k=2), tied)
    kept = support(law)
    assert len(kept) == 2 and 0 in kept and kept - {0} <= {1, 2, 3}
    reference = reference_law(SamplingConfig(1.0, top_k=2), tied)
    assert sorted(law, reverse=True)[:2] == pytest.approx(sorted(reference, reverse=True)[:2])


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_removes_exactly_the_tail(top_p):
    """The tail is what lies past the token whose mass crosses top_p (that token stays)."""
    cfg = SamplingConfig(1.0, top_p=top_p)
    plain, law = fast_law(PLAIN), fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    order = sorted(range(len(LOGITS)), key=lambda i: -plain[i])
    mass = list(itertools.accumulate(math.exp(plain[i]) for i in order))
    crossing = next(n for n, m in enumerate(mass) if m >= top_p)
    assert support(law) == set(order[: crossing + 1])
    assert 0 < crossing < len(LOGITS) - 1  # a tail is removed and more than the first stays
    assert_odds_kept(law, plain)
    assert_same_law(fast_law(SamplingConfig(1.0, top_p=1.0)), plain)


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.4])
def test_min_p_removes_the_tokens_below_a_fraction_of_the_likeliest(min_p):
    cfg = SamplingConfig(1.0, min_p=min_p)
    plain, law = fast_law(PLAIN), fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    best = max(plain)
    kept = {i for i, v in enumerate(plain) if v >= best + math.log(min_p)}
    assert support(law) == kept and 1 < len(kept) < len(LOGITS)
    assert_odds_kept(law, plain)


def test_logit_bias_moves_only_its_tokens():
    cfg = SamplingConfig(1.0, logit_bias={4: 2.5, 6: -1.25})
    law = fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    want = [0.0, 0.0, 0.0, 0.0, 2.5, 0.0, -1.25, 0.0]
    assert log_odds_change(law, fast_law(PLAIN)) == pytest.approx(want, abs=1e-12)


def test_repetition_penalty_moves_every_seen_token_towards_less_likely():
    """HF's: l / r where l > 0, l * r elsewhere, on each token of the prompt and the text."""
    r = 1.7
    cfg = SamplingConfig(1.0, repetition_penalty=r)
    law = fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    seen = set(CONTEXT)
    want = [((v / r if v > 0 else v * r) - v) if i in seen else 0.0 for i, v in enumerate(LOGITS)]
    assert log_odds_change(law, fast_law(PLAIN)) == pytest.approx(want, abs=1e-12)
    assert all(want[i] < 0 for i in seen)


def test_presence_penalty_alone_moves_each_generated_token_once():
    """OpenAI's: the text's tokens lose the penalty once, however often they occur; tokens only
    in the prompt keep their odds."""
    cfg = SamplingConfig(1.0, presence_penalty=0.8)
    law = fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    want = [-0.8 if i in TEXT else 0.0 for i in range(len(LOGITS))]
    assert log_odds_change(law, fast_law(PLAIN)) == pytest.approx(want, abs=1e-12)


def test_frequency_penalty_alone_moves_each_generated_token_per_occurrence():
    cfg = SamplingConfig(1.0, frequency_penalty=0.6)
    law = fast_law(cfg)
    assert_same_law(law, reference_law(cfg))
    want = [-0.6 * TEXT.count(i) for i in range(len(LOGITS))]
    assert log_odds_change(law, fast_law(PLAIN)) == pytest.approx(want, abs=1e-12)
    assert want[3] == 2 * want[5] < 0 and want[1] == want[6] == 0  # twice; prompt only
