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


def test_table_names_the_best_configuration():
    text = roofline.roofline_table(COSTS, [(1, 4), (4, 4)], {(4, 4): 1.9, (1, 4): 1.2})
    assert "| 1 | 4 | 25 | 100 | 2.50 | 2.50 | 1.20 |" in text
    assert "N = 4, K = 4" in text and "(measured)" in text


def test_roofline_runs_on_toy_models(tmp_path):
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    text = roofline.run_roofline(llm, [(2, 2)], [1, 2, 3, 4], tmp_path, reps=2)
    assert "| 2 | 2 |" in text and (tmp_path / "roofline.md").exists()
