"""Prometheus metrics of one server, named as vLLM names them (prefix `smcspec:` for `vllm:`)
so existing dashboards carry over, each labelled with the served `model_name`: requests,
client disconnects (nginx's 499, by stage), tokens, latency, queue, KV pages, speculative
decoding counters (sd's and msd's, as vLLM counts every speculative method in one set), the
draft's agreement with the target (sd, msd, smc), and SMC's own (rounds, resamples, ESS). `role`
tells the target model from the draft. smcspec:graph_replays_total /
smcspec:forward_passes_total is the share of passes a captured CUDA graph served (the rest ran
eagerly)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from smcspec.engine import (
    AutoStats,
    MSDStats,
    PagedModel,
    SDStats,
    SMCStats,
    Stats,
    setting_label,
)

THROUGHPUT_WINDOW_S = 30.0
ROLES = ("target", "draft")
# From GPU milliseconds to CPU minutes: a CPU run measured first tokens at 15 s and requests
# at 28 s, past the 10 s where the default buckets end.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 7.5, 10, 15, 20, 30, 45, 60)
TTFT_BUCKETS += (90, 120, 240, 480)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)
LATENCY_BUCKETS += (300, 480, 960, 1920)
# measured over predicted speed: a tenth off either way is within the 0.9-1.1 buckets
RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
AGREEMENT_DOC = (
    "each choice's mean over its drafted positions of sum_x min(p(x), q(x)), the probability "
    "that sd keeps a draft there (target law p, draft law q), by method"
)


class ServerMetrics:
    """All metrics live in this object's own registry (no process-wide state). Events are
    counted as they happen; the scheduler's state (queue, pages, batches) is read at scrape."""

    def __init__(self, scheduler: Any, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "smcspec:http_requests",
            "HTTP requests by endpoint and status",
            ["model_name", "endpoint", "status"],
            registry=r,
        )
        self.disconnects = Counter(
            "smcspec:client_disconnects",
            "clients that hung up before their response ended (HTTP 499), by stage: sending the "
            "head, sending the body, waiting for a result, or reading a stream",
            ["model_name", "stage"],
            registry=r,
        )
        self.finished = Counter(
            "smcspec:request_success",
            "choices finished, by reason (stop: EOS or a stop string; length: max_tokens)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.tokens = Counter(
            "smcspec:generation_tokens",
            "tokens returned to clients",
            ["model_name", "method"],
            registry=r,
        )
        self.prompt_tokens = self._counter("smcspec:prompt_tokens", "prompt tokens")
        self.sd_drafts = self._counter("smcspec:spec_decode_num_drafts", "sd and msd rounds")
        self.sd_draft_tokens = self._counter(
            "smcspec:spec_decode_num_draft_tokens",
            "sd and msd draft positions checked (msd: the tree's nodes whose drafts were tested)",
        )
        self.sd_accepted = self._counter(
            "smcspec:spec_decode_num_accepted_tokens", "sd and msd draft tokens accepted"
        )
        self.smc_rounds = self._counter("smcspec:smc_rounds", "smc rounds")
        self.smc_resamples = self._counter("smcspec:smc_resamples", "smc resampling steps")
        self.smc_ess = self._histogram(
            "smcspec:smc_ess_fraction", "ESS / N after each smc round", FRACTION_BUCKETS
        )
        self.agreement = Histogram(
            "smcspec:spec_decode_draft_agreement",
            AGREEMENT_DOC,
            ["model_name", "method"],
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self._auto_metrics()
        self.first_token = self._histogram(
            "smcspec:time_to_first_token_seconds", "time to the first streamed text", TTFT_BUCKETS
        )
        self.latency = self._histogram(
            "smcspec:e2e_request_latency_seconds", "request wall time", LATENCY_BUCKETS
        )
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()
        r.register(_Live(self))

    def _auto_metrics(self) -> None:
        """auto's: the rounds of each setting it chose, its measured over predicted speed."""
        self.auto_rounds = Counter(
            "smcspec:auto_rounds",
            "rounds auto ran, by the setting it chose (method, N, K)",
            ["model_name", "setting"],
            registry=self.registry,
        )
        self.auto_speed = self._histogram(
            "smcspec:auto_measured_over_predicted",
            "each setting auto chose: its measured tokens/s over the tokens/s it predicted",
            RATIO_BUCKETS,
        )

    def _counter(self, metric: str, doc: str) -> Any:
        """A counter's only series, this server's model's."""
        family = Counter(metric, doc, ["model_name"], registry=self.registry)
        return family.labels(self.model_name)

    def _histogram(self, metric: str, doc: str, buckets: tuple[float, ...]) -> Any:
        family = Histogram(metric, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return family.labels(self.model_name)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def count_disconnect(self, stage: str) -> None:
        self.disconnects.labels(self.model_name, stage).inc()

    def record_choice(
        self, method: str, new_tokens: int, finish_reason: str, rounds: int, stats: Stats | None
    ) -> None:
        """One finished choice: its tokens, why it ended, its rounds and its method's figures."""
        self.tokens.labels(self.model_name, method).inc(new_tokens)
        self.finished.labels(self.model_name, finish_reason).inc()
        with self._lock:
            self._recent.append((time.monotonic(), new_tokens))
        if isinstance(stats, SDStats | MSDStats):
            self.sd_drafts.inc(rounds)
        if isinstance(stats, AutoStats):
            by_method = stats.rounds_by_method
            self.sd_drafts.inc(by_method.get("sd", 0) + by_method.get("msd", 0))
        if isinstance(stats, SDStats | MSDStats | AutoStats):
            self.sd_draft_tokens.inc(stats.proposed_tokens)
            self.sd_accepted.inc(stats.accepted_tokens)
        for chosen in getattr(stats, "settings", None) or ():
            self._record_setting(chosen)
        if isinstance(stats, SMCStats):
            n = len(stats.weights) or 1
            self.smc_rounds.inc(len(stats.ess))
            self.smc_resamples.inc(stats.resamples)
            for value in stats.ess:
                self.smc_ess.observe(value / n)
        drafting = isinstance(stats, SDStats | MSDStats | SMCStats | AutoStats)
        if drafting and stats.draft_agreement is not None:
            self.agreement.labels(self.model_name, method).observe(stats.draft_agreement)

    def _record_setting(self, chosen: dict[str, Any]) -> None:
        """One setting auto chose (`AutoStats.settings`): its rounds, and how its measured speed
        compared with the prediction it was chosen by."""
        self.auto_rounds.labels(self.model_name, setting_label(chosen)).inc(chosen["rounds"])
        measured, predicted = (
            chosen["measured_tokens_per_second"],
            chosen["predicted_tokens_per_second"],
        )
        if measured is not None and predicted > 0:
            self.auto_speed.observe(measured / predicted)

    def recent_tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Collector of the values read at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, s = self.metrics, self.metrics.scheduler
        name = [m.model_name]
        yield _gauge(
            "smcspec:num_requests_waiting", "requests waiting for KV pages", name, s.queued
        )
        yield _gauge("smcspec:num_requests_running", "requests being decoded", name, s.running)
        yield _gauge(
            "smcspec:avg_generation_throughput_toks_per_s",
            f"generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s",
            name,
            m.recent_tokens_per_second(),
        )
        labels = ["model_name", "role"]
        used = GaugeMetricFamily("smcspec:kv_pages_in_use", "KV pages in use", labels=labels)
        free = GaugeMetricFamily("smcspec:kv_pages_free", "KV pages free", labels=labels)
        usage = GaugeMetricFamily(
            "smcspec:kv_cache_usage_perc", "fraction of KV pages in use (1 = full)", labels=labels
        )
        passes = CounterMetricFamily(
            "smcspec:forward_passes", "batched forward passes", labels=labels
        )
        rows = CounterMetricFamily(
            "smcspec:forward_rows", "sequences carried by the batched passes", labels=labels
        )
        seconds = CounterMetricFamily(
            "smcspec:forward_seconds", "time in batched forward passes", labels=labels
        )
        replays = CounterMetricFamily(
            "smcspec:graph_replays",
            "batched forward passes served by a CUDA-graph replay",
            labels=labels,
        )
        for i, role in enumerate(ROLES[: len(s.models)]):
            if isinstance(s.models[i], PagedModel):
                pool = s.models[i].pages
                total = pool.used_pages + pool.free_pages
                used.add_metric([*name, role], pool.used_pages)
                free.add_metric([*name, role], pool.free_pages)
                usage.add_metric([*name, role], pool.used_pages / total if total else 0.0)
            passes.add_metric([*name, role], s.stats.forwards[i])
            rows.add_metric([*name, role], s.stats.rows[i])
            seconds.add_metric([*name, role], s.stats.seconds[i])
            replays.add_metric([*name, role], s.stats.replays[i])
        yield from (used, free, usage, passes, rows, seconds, replays)


def _gauge(metric: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(metric, doc, labels=["model_name"])
    gauge.add_metric(labels, value)
    return gauge
