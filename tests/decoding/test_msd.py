"""`msd` samples exactly the target's law over whole sequences, in the style of
test_exactness.py: toy models with 4 tokens, the law of every continuation enumerated
(tests/oracle.py), R = 20,000 samples against it by a Pearson chi-square test at level ALPHA,
fixed seeds. Each (N, K) of N in {2, 4} and K in {1, 2, 4} runs once against the far draft, each
under a setting that changes the accept tests (top-k, top-p, the draft at its own temperature,
penalties); K = 4 with 5 new tokens, so that a round drafts 4. The power checks show the
plausible msd bugs of tests/decoding/broken.py rejected by the same test.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient

from smcspec import LLM, cli
from smcspec.cli import generate as cli_generate
from smcspec.config import MAX_PARTICLES, MSDConfig, SamplingConfig
from smcspec.decoding import AutoregressiveDecoder, MultiDraftDecoder, methods, msd
from smcspec.server.app import ServeDefaults, create_app
from tests.decoding import broken
from tests.decoding.conftest import PROMPT
from tests.oracle import sequence_law
from tests.stats import ALPHA, chi_square_pvalue

R = 20000

PENALTIES = {
    "repetition_penalty": 1.8,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.4,
    "logit_bias": {1: 1.5},
}
# (N, K) -> the sampling settings of its case
CASES = {
    (2, 1): SamplingConfig(temperature=0.7, top_k=2, max_new_tokens=3),
    (4, 1): SamplingConfig(temperature=1.0, draft_temperature=0.5, max_new_tokens=3),
    (2, 2): SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=3),
    (4, 2): SamplingConfig(temperature=1.0, max_new_tokens=3, **PENALTIES),
    (2, 4): SamplingConfig(temperature=1.0, draft_temperature=2.0, max_new_tokens=5),
    (4, 4): SamplingConfig(temperature=0.7, top_k=2, max_new_tokens=5),
}


def draw(decoder, cfg: SamplingConfig, seed: int, r: int = R) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(decoder.decode(PROMPT, cfg, g).tokens) for _ in range(r))


@pytest.mark.parametrize(("n", "k"), list(CASES), ids=[f"N{n}-K{k}" for n, k in CASES])
def test_msd_is_exact_with_a_far_draft(target, far_draft, n, k):
    cfg = CASES[n, k]
    samples = draw(MultiDraftDecoder(target, far_draft, MSDConfig(n, k)), cfg, seed=7)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) > ALPHA


def test_msd_drafts_all_k_tokens_in_the_long_cases(target):
    """The K = 4 cases above are real: with 5 new tokens a round drafts 4 tokens a row (a draft
    equal to the target at T = 0 has all 4 accepted: one round)."""
    cfg = SamplingConfig(0.0, max_new_tokens=5, stop_at_eos=False)
    out = MultiDraftDecoder(target, target, MSDConfig(4, 4)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0)
    )
    assert out.rounds == 1 and out.stats.accepted_lengths == [4] and len(out.tokens) == 5


# (N, K, settings): the vectorised walk against the plain loop, where they could part: ties of
# drafts (greedy, top-k 1 draft), many rejections (a hot draft), N = 1 (sd), long rounds.
WALKS = [
    (1, 3, SamplingConfig(1.0, max_new_tokens=7)),
    (3, 2, SamplingConfig(1.0, draft_temperature=2.0, max_new_tokens=7)),
    (4, 3, SamplingConfig(0.7, top_k=2, max_new_tokens=7)),
    (4, 2, SamplingConfig(1.0, top_p=0.7, max_new_tokens=7, **PENALTIES)),
    (3, 3, SamplingConfig(0.0, draft_temperature=1.0, max_new_tokens=7)),
    (5, 4, SamplingConfig(1.0, max_new_tokens=9, stop_at_eos=False)),
]


@pytest.mark.parametrize(("n", "k", "cfg"), WALKS)
def test_the_vectorised_walk_is_the_plain_loop(target, far_draft, n, k, cfg):
    """Same seed, same uniforms: `msd.verify` (the residuals in closed form, the tests of a depth
    at once) commits what SpecInfer's loop one test at a time commits (`broken.tree_walk`)."""
    fast = MultiDraftDecoder(target, far_draft, MSDConfig(n, k))
    plain = broken.MSDReference(target, far_draft, MSDConfig(n, k))
    for seed in range(40):
        a = fast.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        b = plain.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens and a.stats == b.stats, seed


BUGS = {
    broken.MSDResidualNotUpdated: (4, 1, SamplingConfig(1.0, max_new_tokens=3)),
    broken.MSDTestsAgainstP: (4, 1, SamplingConfig(1.0, max_new_tokens=3)),
    broken.MSDKeepsMismatchedDrafts: (4, 2, SamplingConfig(1.0, max_new_tokens=3)),
    broken.MSDBonusFromDraft: (2, 1, SamplingConfig(1.0, max_new_tokens=2)),
}


@pytest.mark.parametrize("bug", list(BUGS), ids=[b.__name__ for b in BUGS])
def test_power_plausible_msd_bugs_are_caught(target, far_draft, bug):
    """Each bug is rejected from a fifth of the exactness tests' R samples: rejecting with fewer
    samples is the stronger claim (the chi-square's power only grows with R). Measured at R / 5:
    p = 2e-159, 2e-239, 4e-25 and 0 for the four, far below ALPHA = 1e-4."""
    n, k, cfg = BUGS[bug]
    samples = draw(bug(target, far_draft, MSDConfig(n, k)), cfg, seed=8, r=R // 5)
    assert chi_square_pvalue(samples, sequence_law(target, PROMPT, cfg)) < ALPHA


@pytest.mark.parametrize("draft_temperature", [None, 1.0])
def test_greedy_msd_equals_greedy_ar(target, far_draft, draft_temperature):
    """At T = 0 p is a point mass: a draft is kept only where it is p's arg-max, and the residual
    is p itself. With draft_temperature 1 the rows draft different tokens."""
    cfg = SamplingConfig(0.0, max_new_tokens=6, draft_temperature=draft_temperature)
    g = torch.Generator().manual_seed(0)
    ar = AutoregressiveDecoder(target).decode(PROMPT, cfg, g).tokens
    for n, k in [(1, 1), (2, 3), (4, 2)]:
        out = MultiDraftDecoder(target, far_draft, MSDConfig(n, k)).decode(PROMPT, cfg, g)
        assert out.tokens == ar, (n, k)


def test_never_more_than_max_new_tokens_and_eos_ends(target, far_draft):
    for max_new in (1, 2, 4, 7):
        cfg = SamplingConfig(1.0, max_new_tokens=max_new)
        dec = MultiDraftDecoder(target, far_draft, MSDConfig(3, 4))
        for seed in range(30):
            out = dec.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
            assert 1 <= len(out.tokens) <= max_new
            eos = [i for i, x in enumerate(out.tokens) if x in target.eos_token_ids]
            assert eos in ([], [len(out.tokens) - 1])  # an EOS is the last token
            assert len(out.tokens) == max_new or eos


def test_a_watch_stops_decoding_after_its_round(target, far_draft):
    seen: list[list[int]] = []

    def watch(tokens: list[int]) -> bool:
        seen.append(list(tokens))
        return True

    cfg = SamplingConfig(1.0, max_new_tokens=9, stop_at_eos=False)
    out = MultiDraftDecoder(target, far_draft, MSDConfig(2, 2)).decode(
        PROMPT, cfg, torch.Generator().manual_seed(0), watch
    )
    assert out.stats.stopped and out.rounds == 1 and seen == [out.tokens]


def test_a_seed_reproduces_msd(target, far_draft):
    cfg = SamplingConfig(1.0, max_new_tokens=6)
    dec = MultiDraftDecoder(target, far_draft, MSDConfig(3, 2))
    runs = [
        [dec.decode(PROMPT, cfg, torch.Generator().manual_seed(s)).tokens for s in range(30)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_rows_restart_from_the_winner(target, far_draft):
    """After each round every cache row holds the committed text but its newest token (the
    draft's may lag one more): a row left on a losing draft would feed the next round a wrong
    prefix (the toy cache holds the prefixes themselves). The winner is not always row 0."""
    dec = MultiDraftDecoder(target, far_draft, MSDConfig(4, 3))
    restart, seen = dec.restart, []

    def spy(pair, seq_len, winner):
        restart(pair, seq_len, winner)
        if winner is not None:
            seen.append((winner, seq_len, [list(cache.rows) for cache in pair]))

    dec.restart = spy
    cfg = SamplingConfig(1.0, draft_temperature=1.5, max_new_tokens=12, stop_at_eos=False)
    winners = []
    for seed in range(10):
        seen.clear()
        out = dec.decode(PROMPT, cfg, torch.Generator().manual_seed(seed))
        text = tuple(PROMPT + out.tokens)
        for winner, seq_len, (t_rows, d_rows) in seen:
            winners.append(winner)
            assert len(t_rows) == len(d_rows) == 4
            assert all(row == text[: seq_len - 1] for row in t_rows)
            assert all(row in (text[: seq_len - 1], text[: seq_len - 2]) for row in d_rows)
    assert any(w != 0 for w in winners)


def test_stats():
    # rounds of K = 3 reaching depths 3, 0, 1, and a last one of K = 1 reaching 1
    stats = msd._stats(False, 5, [(3, 3), (3, 0), (3, 1), (1, 1)], 9)
    assert stats.accepted_lengths == [3, 0, 1, 1]
    # depth 1: 3 of 4 rounds accept; depth 2: of the 2 that got there with drafts left, 1;
    # depth 3: 1 of 1
    assert stats.acceptance_by_depth == [0.75, 0.5, 1.0]
    assert stats.mean_accepted_length == 1.25 and stats.tokens_per_round == 2.25
    assert msd._stats(False, 0, [(0, 0)], 1).acceptance_by_depth == []


def test_residual_scales_are_the_iterated_residual():
    """r_m = (p - c_m q)+ / S_m equals max(r_{m-1} - q, 0) normalized, m times over."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 7, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(3, 7, generator=g, dtype=torch.float64), -1)
    c, total = msd.residual_scales(p, q, 3)
    r = p
    for m in range(4):
        torch.testing.assert_close(msd.residual(p, q, c[m, :, None], total[m, :, None]), r)
        rest = (r - q).clamp_min(0)
        r = rest / rest.sum(-1, keepdim=True)


# -- the front ends and the native engine ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(str(tiny_llama_folder), str(tiny_llama_draft_folder), dtype="float32")


def test_greedy_msd_equals_greedy_ar_on_the_tiny_native_model(tiny_llm):
    """Rows forked from the winner by page tables and cropped, every round: greedy msd is greedy
    ar token for token, and every page goes back."""
    assert tiny_llm.backend == "native"
    settings = {"temperature": 0.0, "max_new_tokens": 24, "seed": 0, "stop_at_eos": False}
    ar = tiny_llm.generate("w1 w2 w3", "ar", **settings)
    for n, k in [(2, 3), (4, 2)]:
        out = tiny_llm.generate("w1 w2 w3", "msd", particles=n, draft_tokens=k, **settings)
        assert out.token_ids == ar.token_ids, (n, k)
        assert out.stats.accepted_tokens > 0  # the drafts were used, not only p
        assert tiny_llm.target.pages.used_pages == tiny_llm.draft.pages.used_pages == 0


def test_msd_reaches_its_config_from_python_the_cli_and_http(tiny_llm, monkeypatch, capsys):
    """ "msd" comes from the method table to every front end: `--particles` / `-k` and the body's
    `particles` / `draft_tokens` reach MSDConfig through the one converter, bounded by
    MAX_PARTICLES as smc's N is."""
    built: list[MSDConfig] = []
    row = methods.TABLE["msd"]

    def decoder(target, draft, config, potential, tuner):
        built.append(config)
        return row.decoder(target, draft, config, potential, tuner)

    _ = tiny_llm.tuner.costs  # auto's profile (a server measures it at start) runs msd too
    monkeypatch.setitem(methods.TABLE, "msd", dataclasses.replace(row, decoder=decoder))
    out = tiny_llm.generate("w1 w2", "msd", particles=3, draft_tokens=2, max_new_tokens=4, seed=0)
    assert out.method == "msd" and built == [MSDConfig(3, 2)]
    assert set(out.diagnostics) >= {"accepted_lengths", "acceptance_by_depth"}

    monkeypatch.setattr(cli_generate, "llm_from_args", lambda args, **kwargs: tiny_llm)
    argv = ["generate", "w1 w2", "--method", "msd", "--particles", "3", "-k", "2"]
    assert cli.main([*argv, "--max-new-tokens", "4", "--seed", "0", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["method"] == "msd" and printed["token_ids"] == out.token_ids
    assert built[1:] == [MSDConfig(3, 2)]
    assert cli.main([*argv[:-4], "--particles", str(MAX_PARTICLES + 1)]) == 2

    body = {"model": "tiny", "prompt": "w1 w2", "method": "msd", "particles": 3}
    with TestClient(create_app(tiny_llm, ServeDefaults("tiny"))) as client:
        reply = client.post("/v1/completions", json=body | {"draft_tokens": 2, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["smcspec"]["method"] == "msd"
        assert built[2:] == [MSDConfig(3, 2)]
        too_many = client.post("/v1/completions", json=body | {"particles": MAX_PARTICLES + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "particles"
