import json

import pytest

from smcspec.bench import report
from smcspec.bench.results import ResultLog, header, machines, measurements, read


def test_wilson_interval_known_values():
    low, high = report.wilson_interval(10, 20)
    assert (round(low, 4), round(high, 4)) == (0.2993, 0.7007)
    low, high = report.wilson_interval(0, 10)
    assert low == 0.0 and round(high, 4) == 0.2775
    low, high = report.wilson_interval(20, 20)
    assert round(low, 4) == 0.8389 and high == 1.0
    # where rounding left 0/3's lower bound at 5.6e-17, above the estimate it bounds
    assert [report.wilson_interval(0, n)[0] for n in range(1, 40)] == [0.0] * 39
    assert [report.wilson_interval(n, n)[1] for n in range(1, 40)] == [1.0] * 39
    with pytest.raises(ValueError):
        report.wilson_interval(0, 0)


def test_wilson_interval_covers_at_the_nominal_rate():
    # Exact coverage of the 95% interval at n = 40, p = 0.3, summed over the binomial law.
    from scipy import stats

    n, p = 40, 0.3
    coverage = sum(
        stats.binom.pmf(k, n, p)
        for k in range(n + 1)
        if report.wilson_interval(k, n)[0] <= p <= report.wilson_interval(k, n)[1]
    )
    assert 0.93 <= coverage <= 0.97


def test_pareto_front():
    points = [(1.0, 0.5), (2.0, 0.4), (1.5, 0.3), (0.5, 0.6), (2.0, 0.2)]
    assert sorted(report.pareto_front(points)) == [0, 1, 3]


def test_result_log_resumes_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    log = ResultLog(path, {"machine": {"cpu": "x"}})
    log.add("a", {"v": 1})
    log.add("b", {"v": 2})
    with path.open("a") as f:
        f.write('{"key": "c", "v"')  # killed mid-write
    again = ResultLog(path, {"machine": {"cpu": "x"}})
    assert again.has("a") and again.has("b") and not again.has("c")
    assert [r["v"] for r in measurements(path)] == [1, 2]
    assert header(path)["machine"]["cpu"] == "x"  # the header is written once
    assert machines(path) == [{"cpu": "x"}]  # the same machine: nothing more to say
    again.add("c", {"v": 3})  # after the torn line, not glued to it
    assert [r["v"] for r in measurements(path)] == [1, 2, 3]


def test_a_run_resumed_on_another_machine_says_so_once(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultLog(path, {"machine": {"cpu": "x"}}).add("a", {"v": 1})
    ResultLog(path, {"machine": {"cpu": "y"}}).add("b", {"v": 2})
    ResultLog(path, {"machine": {"cpu": "y"}}).add("c", {"v": 3})  # resumed again there
    ResultLog(path, {"machine": {"cpu": "z"}})  # found nothing left to run: ran nothing there
    assert machines(path) == [{"cpu": "x"}, {"cpu": "y"}]
    moved = [r for r in read(path) if r.get("kind") == "resumed"]
    assert moved == [{"kind": "resumed", "machine": {"cpu": "y"}, "after": 1}]
    assert header(path)["machine"]["cpu"] == "x"
    assert [r["v"] for r in measurements(path)] == [1, 2, 3]


def _box(cpu: str) -> dict:
    """A machine as `machine.describe` records it, named by its CPU."""
    return {
        "cpu": cpu,
        "cores": 2,
        "torch_threads": 2,
        "gpu": None,
        "device": "cpu",
        "torch": "2.13.0+cpu",
        "precision": "int8, native backend",
    }


def test_a_tables_caption_names_the_machine_a_run_resumed_on(tmp_path):
    from smcspec.bench import tables

    models = {"target": "T", "draft": "D"}
    path = tmp_path / "run" / "accuracy.jsonl"
    ResultLog(path, {"machine": _box("Xeon"), "models": models}).add("a", {"v": 1})
    assert "resumed" not in tables.caption(path, tmp_path)
    ResultLog(path, {"machine": _box("EPYC"), "models": models}).add("b", {"v": 2})
    said = tables.caption(path, tmp_path)
    assert said.index("Xeon") < said.index("resumed on EPYC"), said


def _rec(label, prompt, tps, temp=0.7, **extra):
    return {
        "label": label,
        "method": label.split()[0],
        "temperature": temp,
        "prompt": prompt,
        "rep": 0,
        "tokens_per_second": tps,
        **extra,
    }


def test_speed_summary_pairs_runs_with_ar():
    records = [
        _rec("ar", 0, 2.0),
        _rec("ar", 1, 4.0),
        _rec("sd K=2", 0, 3.0, acceptance_rate=0.5, mean_accepted_length=1.0),
        _rec("sd K=2", 1, 4.0, acceptance_rate=0.7, mean_accepted_length=1.4),
        _rec(
            "smc N=2 K=2",
            0,
            1.0,
            new_tokens=4,
            seconds=4.0,
            ess=[2.0, 1.5],
            resamples=1,
            rounds=2,
            time_split={"prefill": 1, "draft": 1, "verify": 2, "resample": 0, "other": 0},
        ),
        _rec(
            "smc N=2 K=2",
            1,
            2.0,
            new_tokens=8,
            seconds=4.0,
            ess=[2.0, 2.0],
            resamples=0,
            rounds=2,
            time_split={"prefill": 1, "draft": 1, "verify": 2, "resample": 0, "other": 0},
        ),
    ]
    rows = {r["label"]: r for r in report.speed_summary(records)}
    assert rows["ar"]["vs_ar"] == 1.0
    assert rows["sd K=2"]["vs_ar"] == pytest.approx((1.5 + 1.0) / 2)  # median of paired ratios
    assert rows["sd K=2"]["median_tps"] == 3.5 and rows["sd K=2"]["acceptance_rate"] == 0.6
    assert rows["smc N=2 K=2"]["mean_ess"] == pytest.approx(1.875)
    assert rows["smc N=2 K=2"]["min_ess"] == 1.5 and rows["smc N=2 K=2"]["resample_rate"] == 0.25
    assert rows["smc N=2 K=2"]["frac_verify"] == pytest.approx(0.5)
    # decode leaves the prefill out: 4 and 8 tokens in 4 - 1 s, median of 4/3 and 8/3
    assert rows["smc N=2 K=2"]["median_decode_tps"] == pytest.approx(2.0)
    assert rows["sd K=2"]["median_decode_tps"] is None  # no prefill timed
    table = report.speed_table(report.speed_summary(records))
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 3
    assert lines[3].startswith("| sd K=2 | 0.7 | 2 | 3.50 | 3.00-4.00 | 1.25x | - | 0.60 |")
    assert "| 25% / 25% / 50% / 0% / 0% |" in lines[4]


def test_accuracy_summary_and_table():
    records = [
        {"label": "ar", "passed": i < 3, "new_tokens": 10, "seconds": 5.0, "mean_target_logp": -0.5}
        for i in range(4)
    ]
    (row,) = report.accuracy_summary(records)
    assert row["pass_at_1"] == 0.75 and row["tokens_per_second"] == 2.0
    assert (row["ci_low"], row["ci_high"]) == report.wilson_interval(3, 4)
    assert "| ar | 4 | 0.750 (3/4) |" in report.accuracy_table([row])


def test_mcnemar_exact_known_values():
    """Two-sided exact p of b discordant pairs one way and c the other: 2 P(X <= min(b, c)),
    X ~ Binomial(b + c, 1/2), at most 1; checked against scipy's binomial test."""
    from scipy.stats import binomtest

    assert report.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)  # 2 (1 + 10) / 2^10
    assert report.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert report.mcnemar_exact(0, 0) == 1.0 and report.mcnemar_exact(4, 4) == 1.0
    for b, c in [(3, 12), (20, 31), (7, 0), (50, 30)]:
        assert report.mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue)
    with pytest.raises(ValueError, match=">= 0"):
        report.mcnemar_exact(-1, 2)


def test_the_summary_pairs_each_method_with_ar_on_shared_problems():
    """smc solves problems 0-9 that ar failed and fails 10-11 that ar solved, on the 20 both
    ran (its 21st has no ar run to pair with): +8/20, McNemar's p over 10 vs 2."""

    def rec(label, i, passed, seconds):
        return {
            "label": label,
            "task_id": f"t/{i}",
            "passed": passed,
            "new_tokens": 10,
            "seconds": seconds,
        }

    ar = [rec("ar", i, 10 <= i < 20, 1.0) for i in range(20)]
    smc = [rec("smc N=2 K=4", i, i < 10 or i >= 12, 0.5) for i in range(21)]
    sd = [rec("sd K=4", i, 10 <= i < 20, 2.0) for i in range(20)]
    rows = {r["label"]: r for r in report.accuracy_summary(ar + smc + sd)}
    assert "paired" not in rows["ar"]
    smc_row = rows["smc N=2 K=4"]
    assert (smc_row["paired"], smc_row["only_base"], smc_row["only_this"]) == (20, 2, 10)
    assert smc_row["delta"] == pytest.approx(8 / 20)
    assert smc_row["mcnemar_p"] == pytest.approx(report.mcnemar_exact(2, 10))
    assert rows["sd K=4"]["mcnemar_p"] == 1.0 and rows["sd K=4"]["delta"] == 0
    # smc is both faster and more accurate: alone on the front
    assert [label for label, r in rows.items() if r["frontier"]] == ["smc N=2 K=4"]
    table = report.accuracy_table(list(rows.values()))
    assert "| +0.400 on 20 (2/10, p = 0.039) |" in table


def test_plots_are_written(tmp_path):
    rows = [{"label": "ar", "temperature": t, "median_tps": 1.0 + t} for t in (0.3, 0.7)]
    report.plot_temperature(rows, tmp_path / "t.png", "title")
    acc = [
        {"label": "ar", "tokens_per_second": 2.0, "pass_at_1": 0.5, "ci_low": 0.3, "ci_high": 0.7}
    ]
    report.plot_pareto(acc, tmp_path / "p.png", "title")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "p.png").stat().st_size > 1000
    json.dumps(rows)


def test_msd_and_auto_rows_count_acceptance_and_share_auto_s_rounds():
    seg = {"method": "sd", "draft_tokens": 4, "rounds": 5}
    records = [
        _rec("ar", 0, 2.0),
        _rec("msd N=2 K=4", 0, 3.0, accepted_tokens=6, proposed_tokens=8),
        _rec("msd N=2 K=4", 1, 3.0, accepted_tokens=3, proposed_tokens=4),
        _rec("auto", 0, 3.0, accepted_tokens=1, proposed_tokens=4, chosen=[{**seg, "rounds": 2}]),
        _rec(
            "auto",
            1,
            3.0,
            accepted_tokens=0,
            proposed_tokens=0,
            chosen=[seg, {"method": "msd", "particles": 2, "draft_tokens": 3, "rounds": 3}],
        ),
        # smc reports no rate: its row stays without one, counts or not
        _rec("smc N=2 K=2", 0, 1.0, accepted_tokens=1, proposed_tokens=2),
    ]
    rows = {r["label"]: r for r in report.speed_summary(records)}
    assert rows["msd N=2 K=4"]["acceptance_rate"] == 9 / 12  # pooled, not a mean of rates
    assert rows["auto"]["acceptance_rate"] == 1 / 4
    assert rows["smc N=2 K=2"]["acceptance_rate"] is None
    assert rows["auto"]["chose"] == "sd K=4 (70%), msd N=2 K=3 (30%)"
    assert rows["ar"]["chose"] is None
    lines = report.speed_table(list(rows.values())).splitlines()
    assert lines[0].endswith("| auto chose (share of rounds) |") and lines[1].count("---") == 14
    assert lines[-1].endswith("| sd K=4 (70%), msd N=2 K=3 (30%) |")
    # without auto the table is the one it always was
    plain = report.speed_table([rows["ar"], rows["msd N=2 K=4"]]).splitlines()
    assert plain[0].endswith("| prefill / draft / verify / resample / other |")
    assert all(line.count("|") == 14 for line in plain)


def _row(label, tps, temp=1.0, draft_t=None, method=None, **extra):
    method = method or label.split()[0]
    return {
        "label": label,
        "method": method,
        "temperature": temp,
        "median_tps": tps,
        "draft_temperature": draft_t,
        "acceptance_rate": None,
        **extra,
    }


def test_best_fixed_names_the_fastest_setting_per_cell_and_auto_s_ratios():
    rows = [
        _row("ar", 10.0),
        _row("sd K=4", 14.0, acceptance_rate=0.7),
        _row("sd K=2", 12.0, acceptance_rate=0.8),
        _row("msd N=2 K=4", 15.0),
        _row("smc N=2 K=8", 20.0),
        _row("smc N=2 K=8 power=2", 40.0),  # another target: not a setting auto could pick
        _row("auto", 14.4),
        _row("auto approx", 19.0, method="auto-approx"),
        _row("sd K=4 draft T=2", 8.0, draft_t=2.0, acceptance_rate=0.3),
        _row("msd N=2 K=4 draft T=2", 9.0, draft_t=2.0),
        _row("auto draft T=2", 9.5, draft_t=2.0),
        _row("ar", 30.0, temp=0.7),  # another temperature: another cell's ar
    ]
    cells = report.best_fixed(rows)
    assert [(c["temperature"], c["draft_temperature"]) for c in cells] == [(1.0, None), (1.0, 2.0)]
    same, hot = cells
    assert same["best_exact"]["label"] == "msd N=2 K=4"
    assert same["best_fixed"]["label"] == "smc N=2 K=8"
    assert same["auto_vs_best_exact"] == pytest.approx(14.4 / 15)
    assert same["auto_vs_ar"] == pytest.approx(1.44)
    assert same["approx_vs_best_fixed"] == pytest.approx(0.95)
    assert same["sd_acceptance"] == 0.7 and same["msd_vs_sd"] == pytest.approx(15 / 14)
    # ar drafts nothing: it is the cell's best exact setting at every draft temperature
    assert hot["best_exact"]["label"] == "ar" and hot["auto_vs_best_exact"] == 0.95
    assert hot["approx_vs_best_fixed"] is None and hot["sd_acceptance"] == 0.3
    table = report.best_fixed_table(cells).splitlines()
    assert table[2] == (
        "| 1.0 | target's | msd N=2 K=4 | 15.00 | 0.96x | 1.44x | smc N=2 K=8 | 20.00 | 0.95x "
        "| 0.70 | 1.07x |"
    )
    assert table[3].startswith("| 1.0 | 2 | ar | 10.00 | 0.95x | 0.95x | ar | 10.00 | - |")


def test_best_fixed_counts_sd_and_msd_variants_as_the_exact_settings_they_are():
    """A lookup or block-rule row is an sd or msd setting: it can be the cell's best exact one
    (a report that knew only the method table's names left it out)."""
    rows = [
        _row("ar", 10.0),
        _row("sd K=4", 12.0, acceptance_rate=0.9),
        _row("sd K=8 lookup", 13.0, method="sd-lookup"),
        _row("msd N=2 K=4 lookup+draft", 11.0, method="msd-lookup-draft"),
        _row("llama.cpp", 30.0, method="llama-cpp"),  # a peer: no setting of ours
    ]
    [cell] = report.best_fixed(rows)
    assert cell["best_exact"]["label"] == cell["best_fixed"]["label"] == "sd K=8 lookup"
    assert cell["sd_acceptance"] == 0.9  # sd's own rows still give sd's acceptance


def test_every_caption_names_the_machines_in_the_order_they_ran():
    from smcspec.bench.machine import ran_on

    boxes = [_box(cpu) for cpu in ("Xeon", "EPYC", "Ryzen")]
    assert ran_on([]) == "machine not recorded"
    assert ran_on(boxes[:1]).startswith("Xeon (2 cores") and "resumed" not in ran_on(boxes[:1])
    said = report.speed_caption({"plan": {"prompts": 3}}, boxes)
    assert said.index("Xeon") < said.index("resumed on EPYC") < said.index("resumed on Ryzen")
