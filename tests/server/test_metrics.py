"""Prometheus metrics under vLLM's names (prefix smcspec:), each labelled with the model name,
with histogram buckets that cover the latencies measured on a CPU."""

import math
import re
from types import SimpleNamespace

import pytest

from smcspec.bench.serving import parse_metrics
from smcspec.decoding import ARStats, MSDStats, SDStats, SMCStats
from smcspec.decoding.auto_contract import AutoStats
from smcspec.server.metrics import ServerMetrics


def fake_scheduler():
    pages = SimpleNamespace(used_pages=3, free_pages=5)
    stats = SimpleNamespace(forwards=[7, 9], rows=[20, 30], seconds=[1.5, 0.5], replays=[6, 0])
    paged = dict(  # what `models.base.PagedModel` declares
        pages=pages, page_size=4, context_length=64, device="cpu", vocab_size=8,
        eos_token_ids=frozenset(), new_cache=print, forward=print, forward_many=print,
    )  # fmt: skip
    target, draft = SimpleNamespace(**paged), SimpleNamespace(**paged)
    return SimpleNamespace(queued=2, running=1, models=(target, draft), stats=stats)


@pytest.fixture
def metrics():
    return ServerMetrics(fake_scheduler(), "tiny")


def buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative counts of a histogram by upper bound."""
    pattern = rf'^{re.escape(name)}_bucket{{le="([^"]+)",model_name="tiny"}} (\S+)$'
    return {float(le): float(n) for le, n in re.findall(pattern, text, re.MULTILINE)}


def test_names_follow_vllm_and_every_sample_has_the_model_name(metrics):
    metrics.count_request("/v1/completions", 200)
    metrics.prompt_tokens.inc(5)
    metrics.record_choice("sd", 12, "stop", 4, SDStats(False, 10, 7, 0.7, 1.75, 3.0))
    metrics.record_choice("ar", 8, "length", 8, ARStats(False))
    values = parse_metrics(metrics.render().decode())
    m = '{model_name="tiny"}'
    assert values[f"smcspec:num_requests_running{m}"] == 1
    assert values[f"smcspec:num_requests_waiting{m}"] == 2
    assert values[f"smcspec:prompt_tokens_total{m}"] == 5
    assert values['smcspec:generation_tokens_total{method="sd",model_name="tiny"}'] == 12
    assert values['smcspec:request_success_total{finished_reason="stop",model_name="tiny"}'] == 1
    assert values['smcspec:request_success_total{finished_reason="length",model_name="tiny"}'] == 1
    assert values[f"smcspec:spec_decode_num_drafts_total{m}"] == 4
    assert values[f"smcspec:spec_decode_num_draft_tokens_total{m}"] == 10
    assert values[f"smcspec:spec_decode_num_accepted_tokens_total{m}"] == 7
    assert values['smcspec:forward_passes_total{model_name="tiny",role="draft"}'] == 9
    assert values['smcspec:graph_replays_total{model_name="tiny",role="target"}'] == 6
    assert values['smcspec:graph_replays_total{model_name="tiny",role="draft"}'] == 0
    assert values['smcspec:kv_cache_usage_perc{model_name="tiny",role="target"}'] == 3 / 8
    assert all("smcspec:" in key and 'model_name="tiny"' in key for key in values), [
        key for key in values if 'model_name="tiny"' not in key
    ]


def test_latency_buckets_cover_minutes(metrics):
    """Measured on the CPU: first tokens after 15 s, requests of 28 s; a histogram whose last
    finite bucket is 10 s puts them all in +Inf and its quantiles say nothing."""
    metrics.first_token.observe(15.0)
    metrics.latency.observe(28.0)
    metrics.latency.observe(150.0)
    text = metrics.render().decode()
    ttft = buckets(text, "smcspec:time_to_first_token_seconds")
    e2e = buckets(text, "smcspec:e2e_request_latency_seconds")
    assert min(le for le, n in ttft.items() if n == 1) <= 20.0
    assert min(le for le, n in e2e.items() if n >= 1) <= 30.0
    assert min(le for le, n in e2e.items() if n == 2) < math.inf  # 150 s in a finite bucket
    assert max(le for le in e2e if le < math.inf) >= 300.0
    assert min(ttft) <= 0.05 and min(e2e) <= 0.5  # and fine enough for a GPU


def test_smc_metrics_are_kept(metrics):
    stats = SMCStats(False, [2.0, 1.0], 1, 0, [0.5, 0.5], 0.0, 0)
    metrics.record_choice("smc", 6, "stop", 2, stats)
    values = parse_metrics(metrics.render().decode())
    m = '{model_name="tiny"}'
    assert values[f"smcspec:smc_rounds_total{m}"] == 2
    assert values[f"smcspec:smc_resamples_total{m}"] == 1
    assert values[f"smcspec:smc_ess_fraction_count{m}"] == 2
    assert values[f"smcspec:smc_ess_fraction_sum{m}"] == pytest.approx(1.5)


def test_msd_is_counted_as_sd_and_every_drafting_method_reports_its_agreement(metrics):
    sd = SDStats(False, 10, 7, 0.7, 1.75, 3.0, draft_agreement=0.75, agreement_positions=10)
    msd = MSDStats(False, 5, [2, 3], [1.0, 0.5], 2.5, 3.5, 6, 0.55, 6)
    smc = SMCStats(False, [2.0], 0, 0, [0.5, 0.5], 0.0, 0, draft_agreement=0.35)
    metrics.record_choice("sd", 12, "stop", 4, sd)
    metrics.record_choice("msd", 7, "stop", 2, msd)
    metrics.record_choice("smc", 4, "stop", 1, smc)
    metrics.record_choice("ar", 8, "length", 8, ARStats(False))
    values = parse_metrics(metrics.render().decode())
    m = '{model_name="tiny"}'
    assert values[f"smcspec:spec_decode_num_drafts_total{m}"] == 4 + 2
    assert values[f"smcspec:spec_decode_num_draft_tokens_total{m}"] == 10 + 6
    assert values[f"smcspec:spec_decode_num_accepted_tokens_total{m}"] == 7 + 5
    name = "smcspec:spec_decode_draft_agreement"
    for method, mean in [("sd", 0.75), ("msd", 0.55), ("smc", 0.35)]:
        labels = f'{{method="{method}",model_name="tiny"}}'
        assert values[f"{name}_count{labels}"] == 1
        assert values[f"{name}_sum{labels}"] == pytest.approx(mean)
    assert not any('method="ar"' in key for key in values if key.startswith(name))


def test_auto_counts_its_drafts_as_sd_and_each_setting_it_chose(metrics):
    settings = [
        {"method": "sd", "draft_tokens": 4, "rounds": 5, "predicted_tokens_per_second": 10.0,
         "measured_tokens_per_second": 9.0},
        {"method": "msd", "particles": 2, "draft_tokens": 3, "rounds": 2,
         "predicted_tokens_per_second": 8.0, "measured_tokens_per_second": 12.0},
        {"method": "ar", "rounds": 3, "predicted_tokens_per_second": 5.0,
         "measured_tokens_per_second": None},
    ]  # fmt: skip
    stats = AutoStats(False, settings, {"sd": 5, "msd": 2, "ar": 3}, 20, 14, 0.6, 20)
    metrics.record_choice("auto", 30, "length", 10, stats)
    values = parse_metrics(metrics.render().decode())
    m = '{model_name="tiny"}'
    assert values[f"smcspec:spec_decode_num_drafts_total{m}"] == 5 + 2  # not ar's rounds
    assert values[f"smcspec:spec_decode_num_draft_tokens_total{m}"] == 20
    assert values[f"smcspec:spec_decode_num_accepted_tokens_total{m}"] == 14
    rounds = {
        key: value for key, value in values.items() if key.startswith("smcspec:auto_rounds_total")
    }
    assert rounds == {
        'smcspec:auto_rounds_total{model_name="tiny",setting="sd K=4"}': 5,
        'smcspec:auto_rounds_total{model_name="tiny",setting="msd N=2 K=3"}': 2,
        'smcspec:auto_rounds_total{model_name="tiny",setting="ar"}': 3,
    }
    ratio = buckets(metrics.render().decode(), "smcspec:auto_measured_over_predicted")
    assert ratio[0.9] == 1 and ratio[1.5] == 2 and ratio[math.inf] == 2  # 0.9 and 1.5
    agreement = 'smcspec:spec_decode_draft_agreement_sum{method="auto",model_name="tiny"}'
    assert values[agreement] == pytest.approx(0.6)
