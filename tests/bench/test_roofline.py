import pytest

from smcspec import LLM
from smcspec.bench import roofline
from smcspec.models.toy import perturbed_lm, random_lm

COSTS = {
    "target_one": 0.100,
    "draft": {1: 0.025, 4: 0.030},
    "verify": {(1, 4): 0.100, (4, 4): 0.200},
}


def test_memory_bound_model_is_the_papers_formula():
    p = roofline.predict(COSTS, 1, 4)
    assert p["rho"] == pytest.approx(0.25)
    assert p["memory_bound"] == pytest.approx(5 / (0.25 * 4 + 1))  # (K+1) / (rho K + 1) = 2.5
    assert p["measured_costs"] == pytest.approx(5 * 0.1 / (4 * 0.025 + 0.1))


def test_measured_cost_model_charges_wide_batches():
    p = roofline.predict(COSTS, 4, 4)
    assert p["measured_costs"] == pytest.approx(0.5 / (4 * 0.030 + 0.200))
    assert p["measured_costs"] < p["memory_bound"]


def test_sd_rows_use_the_tokens_it_committed_per_round():
    p = roofline.predict(COSTS, 1, 4, tokens_per_round=3.0)
    assert p["measured_costs"] == pytest.approx(3 * 0.1 / (4 * 0.025 + 0.1))
    assert p["memory_bound"] == pytest.approx(3 / (0.25 * 4 + 1))


def test_table_names_the_best_configuration_and_the_share_of_the_roofline():
    measured = {
        ("smc", 4, 4): {"speedup": 1.9, "tokens_per_round": 5.0},
        ("smc", 1, 4): {"speedup": 1.2, "tokens_per_round": 4.0},
        ("sd", 1, 4): {"speedup": 1.35, "tokens_per_round": 3.0},
    }
    rows = [("sd", 1, 4), ("smc", 1, 4), ("smc", 4, 4)]
    text = roofline.roofline_table(COSTS, rows, measured)
    # smc N=1 K=4 committed 4 tokens a round (its last round cut short): 4 in 4 x 25 + 100 ms
    # against 100 ms a token: 2.00, measured 1.20
    assert "| smc | 1 | 4 | 4.00 | 25.0 | 100.0 | 2.00 | 2.00 | 1.20 | 60% |" in text
    # sd K=4 commits 3 tokens a round: 1.50 predicted, 1.35 measured = 90%
    assert "| sd | 1 | 4 | 3.00 | 25.0 | 100.0 | 1.50 | 1.50 | 1.35 | 90% |" in text
    assert "N = 4, K = 4" in text and "(measured)" in text


def test_speed_file_gives_each_rows_speedup_and_tokens_per_round(tmp_path):
    from smcspec.bench.results import ResultLog

    log = ResultLog(tmp_path / "speed.jsonl", {"plan": {}})
    base = {"temperature": 1.0, "prompt": 0, "rep": 0}
    # ar: 30 tokens in 4 s, 1 of them prefill: 10 tok/s decoding; sd: 30 in 3.5 s, 1.5 of them
    # prefill: 15 tok/s decoding, 1.5x (end to end it is only 4 / 3.5 = 1.14x)
    ar = {"method": "ar", "settings": {}, "new_tokens": 30, "seconds": 4.0}
    log.add("a", {**base, **ar, "time_split": {"prefill": 1.0}})
    sd = {"method": "sd", "settings": {"draft_tokens": 4}, "new_tokens": 30, "rounds": 10}
    log.add("b", {**base, **sd, "seconds": 3.5, "time_split": {"prefill": 1.5}})
    power = {"particles": 2, "draft_tokens": 4, "power_alpha": 2.0}
    smc = {"method": "smc", "settings": power, "new_tokens": 30, "rounds": 6, "seconds": 2.0}
    log.add("c", {**base, **smc, "time_split": {"prefill": 1.0}})
    got = roofline.measured_speedups(tmp_path / "speed.jsonl", 1.0)
    assert got == {("sd", 1, 4): {"speedup": pytest.approx(1.5), "tokens_per_round": 3.0}}


def test_roofline_runs_on_toy_models(tmp_path):
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    rows = [("smc", 2, 2), ("sd", 1, 2)]
    text = roofline.run_roofline(llm, rows, [1, 2, 3, 4], tmp_path, reps=2)
    assert "| smc | 2 | 2 |" in text and "| sd | 1 | 2 | - |" in text
    assert (tmp_path / "roofline.md").exists()
