"""`bench law`: its figures against values worked out by hand, its verdicts on exact samplers
and on realistic broken ones (the power check), and the run end to end on toy models."""

import dataclasses
import math

import pytest
import torch

from smcspec import LLM
from smcspec.bench import law
from smcspec.bench.contenders import build_grid
from smcspec.bench.results import measurements
from smcspec.config import SamplingConfig, SDConfig
from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.speculative import SpeculativeDecoder
from smcspec.models.toy import ToyLM, perturbed_lm, random_lm
from tests.bench.test_runs import WordTokenizer
from tests.decoding.broken import SDWithoutResidual

ALPHA = 1e-3  # seeds are fixed: each verdict below is the same on every run
LN2 = math.log(2)


def test_a_token_scored_by_hand():
    """pi = (1/2, 1/4, 1/4) at every position; token 1: log pi + H = -2 ln 2 + 1.5 ln 2,
    Var(log pi) = (1/2 + 2) ln^2 2 - (1.5 ln 2)^2 = ln^2 2 / 4, PIT in [1/2, 3/4)."""
    fixed = ToyLM(lambda prefix: torch.tensor([0.5, 0.25, 0.25]).log(), 3, {0})
    got = law.score(fixed, [2], [1, 1, 0], 1.0, torch.Generator().manual_seed(0))
    assert got["tokens"] == 3
    # token 0: log(1/2) + 1.5 ln 2 = 0.5 ln 2
    assert got["score"] == pytest.approx(2 * (-0.5 * LN2) + 0.5 * LN2, abs=1e-6)
    assert got["variance"] == pytest.approx(3 * LN2**2 / 4, abs=1e-6)
    assert all(0.5 <= u < 0.75 for u in got["pit"][:2]) and 0 <= got["pit"][2] < 0.5
    # the temperature is applied: at T = 1/2 the law is (2/3, 1/6, 1/6)
    cold = law.score(fixed, [2], [0], 0.5, torch.Generator().manual_seed(0))
    h = -(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 6)
    assert cold["score"] == pytest.approx(math.log(2 / 3) + h, abs=1e-6)


def test_scoring_a_few_tokens_at_a_time_changes_nothing():
    """The statistics are taken `rows` tokens at a time to bound memory on long texts; the
    per-token figures are the same whatever the split, and the PIT's uniforms the same draws."""
    target = random_lm(vocab_size=11, seed=3)
    text = [int(t) for t in torch.randint(0, 11, (23,), generator=torch.Generator().manual_seed(4))]
    whole, *split = (
        law.score(target, [1, 2], text, 0.7, torch.Generator().manual_seed(5), rows=rows)
        for rows in (64, 1, 5)
    )
    for got in split:
        assert got["pit"] == whole["pit"]
        assert got["score"] == pytest.approx(whole["score"], rel=1e-12)
        assert got["variance"] == pytest.approx(whole["variance"], rel=1e-12)


def test_summary_against_known_values():
    records = [
        {"tokens": 3, "score": 1.0, "variance": 0.5, "pit": [0.125, 0.375, 0.625]},
        {"tokens": 1, "score": 0.96, "variance": 0.5, "pit": [0.875]},
    ]
    s = law.summary(records)
    assert (s["texts"], s["tokens"]) == (2, 4)
    assert s["z"] == pytest.approx(1.96) and s["p_z"] == pytest.approx(0.049996, abs=1e-6)
    assert s["gap"] == pytest.approx(0.49) and s["half_width"] == pytest.approx(0.49)
    # four values at the middles of four equal bins: the closest a sample of 4 can be
    assert s["ks"] == pytest.approx(0.125) and s["p_ks"] > 0.99


def _texts(decoder, temperature: float, count: int, seed: int) -> list[list[int]]:
    cfg = SamplingConfig(temperature, max_new_tokens=8, stop_at_eos=True)
    g = torch.Generator().manual_seed(seed)
    return [decoder.decode([1], cfg, g).tokens for _ in range(count)]


def _verdict(target, texts: list[list[int]], temperature: float = 0.7) -> dict:
    g = torch.Generator().manual_seed(99)
    return law.summary([law.score(target, [1], t, temperature, g) for t in texts])


@pytest.fixture(scope="module")
def pair():
    target = random_lm(6, seed=11, scale=1.5)
    return target, perturbed_lm(target, seed=13, noise=2.0)


def test_exact_samplers_pass(pair):
    target, draft = pair
    for decoder in (AutoregressiveDecoder(target), SpeculativeDecoder(target, draft, SDConfig(4))):
        s = _verdict(target, _texts(decoder, 0.7, 2000, seed=1))
        assert s["tokens"] > 10_000
        assert s["p_z"] > ALPHA and s["p_ks"] > ALPHA, s


@pytest.mark.parametrize(
    "broken",
    ["draft law", "no residual", "temperature 0.8"],
)
def test_power_realistic_broken_samplers_are_rejected(pair, broken):
    """A draft leaking into the output, sd redrawing a rejection from p instead of the residual
    (tests/decoding/broken.py), and a temperature off by 0.1: each fails one of the two tests
    at the size of the exact samplers' check."""
    target, draft = pair
    decoder, temperature = {
        "draft law": (AutoregressiveDecoder(draft), 0.7),
        "no residual": (SDWithoutResidual(target, draft, SDConfig(4)), 0.7),
        "temperature 0.8": (AutoregressiveDecoder(target), 0.8),
    }[broken]
    s = _verdict(target, _texts(decoder, temperature, 2000, seed=1))
    assert min(s["p_z"], s["p_ks"]) < ALPHA, s


def test_the_run_on_toy_models_writes_a_row_per_method_and_batch_and_resumes(tmp_path):
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5), WordTokenizer())
    plan = law.LawPlan(build_grid(["ar", "sd"], [2], [2], [2]), limit=4, max_new_tokens=5)
    law.run_law(llm, plan, tmp_path)
    text = law.run_law(llm, dataclasses.replace(plan, batch=2), tmp_path)
    records = measurements(tmp_path / "law.jsonl")
    assert len(records) == 2 * 4 * 2
    assert all(len(r["pit"]) == r["tokens"] for r in records)
    # two batches of two (problems 0-1, 2-3): each text is the one its problem gets alone, at
    # seed + its index, in either batch
    texts = {(r["label"], r["batch"], r["index"]): r["token_ids"] for r in records}
    alone = {(label, i): ids for (label, b, i), ids in texts.items() if b == 1}
    assert {(label, i): ids for (label, b, i), ids in texts.items() if b == 2} == alone
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[:2] for row in rows[1:]] == [
        ["| ar", "1"],
        ["| sd K=2", "1"],
        ["| ar", "2"],
        ["| sd K=2", "2"],
    ]
    assert "target ToyLM, draft ToyLM" in text and (tmp_path / "law.md").read_text() == text
    # a killed run loses its last text only, and a rerun redoes just that one
    lines = (tmp_path / "law.jsonl").read_text().splitlines()
    (tmp_path / "law.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    law.run_law(llm, dataclasses.replace(plan, batch=2), tmp_path)
    assert [r["key"] for r in measurements(tmp_path / "law.jsonl")] == [r["key"] for r in records]
    # another length or temperature would sit under the first run's title: refused
    for other in ({"max_new_tokens": 6}, {"temperature": 1.0}):
        with pytest.raises(ValueError, match="give it its own --out"):
            law.run_law(llm, dataclasses.replace(plan, **other), tmp_path)


def test_the_pit_uniforms_are_not_the_ones_the_text_was_drawn_with(tmp_path):
    """Seeded as a text's decode was (seed + index), the PIT's uniforms are the very ones ar drew
    its tokens with, and the KS test rejects exact ar (the first run on the real pair did, at
    p = 0.01 over 12k tokens); the run's own generator passes."""
    target = random_lm(5, seed=1, scale=0.5)
    llm = LLM.from_models(target, perturbed_lm(target, seed=4, noise=0.5), WordTokenizer())
    plan = law.LawPlan(build_grid(["ar"], [2], [2], [2]), limit=100, max_new_tokens=32)
    law.run_law(llm, plan, tmp_path)
    records = measurements(tmp_path / "law.jsonl")
    assert law.summary(records)["p_ks"] > ALPHA
    humaneval = law.task("humaneval")
    prompts = [llm.encode(humaneval.prompt(p), chat=True) for p in humaneval.problems(0, 100)]
    same = [
        law.score(target, prompt, r["token_ids"], 0.7, torch.Generator().manual_seed(r["index"]))
        for prompt, r in zip(prompts, records, strict=True)
    ]
    assert law.summary(same)["p_ks"] < ALPHA


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"task": "gsm8k", "offset": 990, "limit": 20}, "held out .* bench law never runs them"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"batch": 0}, "batch"),
        ({"contenders": []}, "no methods"),
        ({"contenders": build_grid(["hf"], [2], [2], [2])}, "smcspec's own methods"),
    ],
)
def test_bad_plans_are_refused_before_anything_loads(change, message):
    grid = build_grid(["ar"], [2], [2], [2])
    with pytest.raises(ValueError, match=message):
        law.LawPlan(**{"contenders": grid, **change})
