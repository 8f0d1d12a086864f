"""The cost model: the round formulas against exact enumeration and a Monte Carlo
of the tree walk, the choices they lead to, the cache, and a profile of the tiny native pair."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from smcspec.config import ARConfig, MSDConfig, SDConfig, SMCConfig
from smcspec.decoding.round_tokens import msd_tokens_per_round, sd_tokens_per_round
from smcspec.engine import LLM, cost_cache, probes
from smcspec.engine import costs as cm


def flat_costs(
    target_fixed: float, target_per_position: float, draft_fixed: float, draft_per_row: float
) -> cm.StepCosts:
    return cm.StepCosts(
        target_fit=(target_fixed, target_per_position), draft_fit=(draft_fixed, draft_per_row)
    )


@pytest.mark.parametrize("a", [0.0, 0.7, 1.0])
def test_predict_is_the_rows_tokens_over_the_rounds_seconds(a):
    costs = flat_costs(1.0, 0.1, 0.2, 0.05)
    for k in (1, 4):
        sd = cm.predict("sd", SDConfig(draft_tokens=k), a, costs)
        assert sd == pytest.approx(sd_tokens_per_round(a, k) / (k * 0.25 + 1 + 0.1 * (k + 1)))
        msd = cm.predict("msd", MSDConfig(particles=4, draft_tokens=k), a, costs)
        seconds = k * 0.4 + 1 + 0.1 * 4 * (k + 1)
        assert msd == pytest.approx(msd_tokens_per_round(a, 4, k) / seconds)
        smc = cm.predict("smc", SMCConfig(particles=2, draft_tokens=k), a, costs)
        assert smc == pytest.approx((k + 1) / (k * 0.3 + 1 + 0.1 * 2 * (k + 1)))
    assert cm.predict("ar", ARConfig(), a, costs) == pytest.approx(1 / 1.1)


def test_predict_refuses_a_bad_acceptance_or_a_config_of_another_method():
    costs = flat_costs(1.0, 0.0, 0.1, 0.0)
    with pytest.raises(ValueError, match="acceptance"):
        cm.predict("sd", SDConfig(), 1.5, costs)
    with pytest.raises(ValueError, match="'sd' takes a SDConfig"):
        cm.predict("sd", MSDConfig(), 0.5, costs)


def test_fit_affine_recovers_a_line_and_never_goes_negative():
    c, b = cm.fit_affine([(x, 0.5 + 0.1 * x) for x in (1, 2, 4, 8)])
    assert (c, b) == (pytest.approx(0.5), pytest.approx(0.1))
    assert cm.fit_affine([(1, 1.0), (8, 0.9)])[1] == 0.0  # noise on a flat device: no slope


def test_measured_shapes_are_priced_by_their_measurement_others_by_the_fit():
    costs = cm.from_measurements({(1, 1): 1.0, (2, 2): 1.4, (4, 2): 2.0}, {1: 0.1, 2: 0.12})
    assert costs.target(2, 2) == 1.4
    c, b = costs.target_fit
    assert costs.target(8, 4) == pytest.approx(c + 32 * b)


# the default pair's measured passes (int8, 2 Zen 4 cores; seconds): 8 rows run over the line
ROWS_SEEN = {(1, 1): 0.083, (1, 5): 0.110, (4, 1): 0.120, (4, 5): 0.249, (8, 1): 0.133}
ROWS_SEEN |= {(8, 5): 0.416}


def test_a_shared_pass_is_priced_as_the_whole_pass_split_between_the_requests():
    """Eight requests of one row each fill an 8-row pass: each pays an eighth of its measured
    time, not the fit's; past the most rows measured (16), the fit as far off as it was at 8."""
    costs = cm.from_measurements(ROWS_SEEN, {1: 0.045, 4: 0.052, 8: 0.064})
    shared = costs.shared(8)
    assert shared.target(1, 5) == pytest.approx(0.416 / 8)
    assert shared.draft(1) == pytest.approx(0.064 / 8)
    assert shared.round_seconds("sd", 1, 4) is None
    c, b = costs.target_fit
    assert costs.shared(16).target(1, 5) == pytest.approx((c + 80 * b) * 0.416 / (c + 40 * b) / 16)
    dc, db = costs.draft_fit
    assert costs.shared(16).draft(1) == pytest.approx((dc + 16 * db) * 0.064 / (dc + 8 * db) / 16)
    # unmeasured shapes within the rows measured: the fit; one request alone prices a pass
    # of 16 rows as the 16 requests' share of it together
    assert costs.shared(2).target(1, 3) == pytest.approx((c + 6 * b) / 2)
    assert costs.shared(1) is costs
    assert costs.target(16, 5) == pytest.approx(16 * costs.shared(16).target(1, 5))


def test_refresh_moves_the_observed_shapes_a_quarter_of_the_way():
    costs = flat_costs(1.0, 0.0, 0.1, 0.0)
    seen = cm.RoundTimes(rows=2, draft_tokens=4, rounds=10, draft_seconds=8.0, target_seconds=30.0)
    new = cm.refresh(costs, seen)
    assert new.target(2, 5) == pytest.approx(0.75 * 1.0 + 0.25 * 3.0)  # 3 s a pass
    assert new.draft(2) == pytest.approx(0.75 * 0.1 + 0.25 * 0.2)  # 0.2 s a step
    assert new.target(1, 5) == 1.0 and new.draft(1) == 0.1  # other shapes: as they were
    for _ in range(60):
        new = cm.refresh(new, seen)
    assert new.target(2, 5) == pytest.approx(3.0)


def test_the_cache_round_trips_and_a_thread_count_is_part_of_its_key(tmp_path):
    key = {"target": "t", "draft": "d", "dtype": "float32", "device": "cpu", "torch_threads": 1}
    costs = cm.from_measurements({(1, 1): 1.0, (2, 2): 1.5}, {1: 0.1, 2: 0.15}, key)
    path = cost_cache.save(costs, tmp_path)
    assert cost_cache.load(key, tmp_path) == costs
    other = {**key, "torch_threads": 2}
    assert cost_cache.cache_path(other, tmp_path) != path
    assert cost_cache.load(other, tmp_path) is None
    # a file whose own key differs (a copy, a collision of the name's hash) is not taken
    cost_cache.cache_path(other, tmp_path).write_text(path.read_text())
    assert cost_cache.load(other, tmp_path) is None
    path.write_text("{not json")
    assert cost_cache.load(key, tmp_path) is None


def _pair(**fields):
    """What `cache_key` reads of an LLM, float32 on the CPU unless `fields` say otherwise."""
    names = (fields.pop("target", "t"), fields.pop("draft", "d"))
    device = SimpleNamespace(device=fields.pop("device", "cpu"))
    return SimpleNamespace(names=names, target=device, **{"dtype": "float32", **fields})


def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


# each change: (the pair, threads, machine) it makes, and the key's entries it must change
KEY_CHANGES = {
    "target": ({"target": "t2"}, None, None, {"target"}),
    "draft": ({"draft": "d2"}, None, None, {"draft"}),
    "dtype": ({"dtype": "bfloat16"}, None, None, {"dtype", "weights"}),
    "weights' kernel": ({"dtype": "int8", "backend": "hf"}, None, None, {"dtype", "weights"}),
    "device": ({"device": "meta"}, None, None, {"device"}),
    "torch threads": ({}, 2, None, {"torch_threads"}),
    "machine": ({}, None, "another CPU", {"machine"}),
    # nothing else: the backend of unquantized weights, the draft's device, other attributes
    "backend (float32)": ({"backend": "hf"}, None, None, set()),
    "draft's device": ({"draft_device": "meta"}, None, None, set()),
    "another attribute": ({"tokenizer": object(), "limits": "x"}, None, None, set()),
}


@pytest.mark.parametrize("change", list(KEY_CHANGES))
def test_the_cost_cache_key_changes_with_each_field_it_names_and_nothing_else(
    change, tmp_path, monkeypatch
):
    """A profile is read back only for the pair, dtype, kernel, device, threads and machine it
    was timed on; anything else reads it back."""
    fields, threads, machine, changed = KEY_CHANGES[change]
    before = _threads(1)
    try:
        key = cost_cache.cache_key(_pair(backend="native"))
        cost_cache.save(cm.from_measurements({(1, 1): 1.0}, {1: 0.1}, key), tmp_path)
        if threads is not None:
            torch.set_num_threads(threads)
        if machine is not None:
            monkeypatch.setattr(cost_cache, "cpu_model", lambda: machine)
        other = cost_cache.cache_key(_pair(**{"backend": "native", **fields}))
    finally:
        torch.set_num_threads(before)
    assert (
        set(other)
        == set(key)
        == {"target", "draft", "dtype", "weights", "device", "torch_threads", "machine"}
    )
    assert {name for name in key if key[name] != other[name]} == changed
    assert (cost_cache.load(other, tmp_path) is None) == bool(changed)
    assert cost_cache.load(key, tmp_path) is not None


def test_cache_key_names_the_kernel_quantized_weights_run_on(monkeypatch):
    """A profile of fbgemm's int8 must not price int8 on smcspec's kernel, nor one build of that
    kernel another, nor its vector path its AMX tiles."""
    from smcspec.models import cpu_linear

    llm = SimpleNamespace(names=("t", "d"), dtype="int8", target=SimpleNamespace(device="cpu"))
    on_kernel = cpu_linear.runs_int8()  # smcspec's kernel runs int8 on this CPU
    ours = cost_cache.cache_key(llm)
    monkeypatch.setattr(cpu_linear, "matrix_engine", lambda: "another unit")
    other_unit = cost_cache.cache_key(llm)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_linear, "build_key", lambda: "another build")
    rebuilt = cost_cache.cache_key(llm)
    monkeypatch.setattr(cpu_linear.KERNEL, "get", lambda: None)
    fallback = cost_cache.cache_key(llm)
    assert fallback["weights"] == "int8"
    if on_kernel:
        kinds = {ours["weights"], other_unit["weights"], rebuilt["weights"], fallback["weights"]}
        assert len(kinds) == 4
    llm.dtype = "float32"
    assert cost_cache.cache_key(llm)["weights"] == "float32"


def test_profile_measures_the_tiny_native_pair_once(
    tiny_llama_folder, tiny_llama_draft_folder, tmp_path
):
    llm = LLM(
        str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native", dtype="float32"
    )
    # no timed assertion: it took 33 s while other work shared the machine's two cores
    costs = probes.profile(
        llm, rows=(1, 2), max_draft_tokens=2, context=16, reps=1, cache_dir=tmp_path
    )
    assert set(costs.target_seen) == {(r, t) for r in (1, 2) for t in (1, 2, 3)}
    assert set(costs.draft_seen) == {1, 2}
    every = [*costs.target_seen.values(), *costs.draft_seen.values(), costs.target(8, 9)]
    assert all(math.isfinite(s) and s > 0 for s in every), every
    assert costs.key == cost_cache.cache_key(llm)
    # measured once: the second call reads the cache (timed anew, no two medians would agree)
    assert (
        probes.profile(llm, rows=(1,), max_draft_tokens=1, context=16, cache_dir=tmp_path) == costs
    )


def test_each_methods_round_overhead_multiplies_its_passes_and_is_measured_and_kept():
    costs = cm.StepCosts(target_fit=(1.0, 0.0), draft_fit=(0.1, 0.0), overhead={"sd": (2.0, 1.5)})
    assert cm.round_cost("sd", SDConfig(4), 0.5, costs)[1] == pytest.approx(4 * 0.1 * 2 + 1.5)
    assert cm.round_cost("msd", MSDConfig(2, 4), 0.5, costs)[1] == pytest.approx(4 * 0.1 + 1)
    from smcspec.models.toy import perturbed_lm, random_lm

    target = random_lm(5, seed=1)
    measured = probes.measure_rounds(target, perturbed_lm(target, 2, 0.5), costs, [1, 2, 3])
    assert set(measured.overhead) == {"ar", "sd", "msd", "smc"}
    assert set(measured.rounds_seen) == {
        (name, cm.method_row(name).kv_rows(c)[0], cm.method_row(name).lookahead(c))
        for name, c in probes.round_probes()
    }
    # measured rounds price a method's settings by their line along K
    c, b = cm.fit_affine((k, t) for (m, r, k), t in measured.rounds_seen.items() if m == "sd")
    for k in (2, 3, 7):
        assert cm.round_cost("sd", SDConfig(k), 0.5, measured)[1] == pytest.approx(c + b * k)
    assert all(d >= 1 and t >= 1 for d, t in measured.overhead.values())
    assert cm.StepCosts.from_json(measured.to_json()) == measured
