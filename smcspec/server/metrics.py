"""Prometheus metrics of one server: requests, tokens, throughput, queue, KV pages, and each
method's own diagnostics (SD acceptance; SMC ESS and resamples)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

THROUGHPUT_WINDOW_S = 30.0
MODEL_NAMES = ("target", "draft")


class ServerMetrics:
    """All metrics live in this object's own registry (no process-wide state). Events are
    counted as they happen; the scheduler's state (queue, pages, batches) is read at scrape."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "smcspec_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "smcspec_generated_tokens", "tokens returned to clients", ["method"], registry=r
        )
        self.prompt_tokens = Counter("smcspec_prompt_tokens", "prompt tokens", registry=r)
        self.smc_rounds = Counter("smcspec_smc_rounds", "smc rounds", registry=r)
        self.smc_resamples = Counter("smcspec_smc_resamples", "smc resampling steps", registry=r)
        self.smc_ess = Histogram(
            "smcspec_smc_ess_fraction",
            "ESS / N after each smc round",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.first_token = Histogram(
            "smcspec_time_to_first_token_seconds", "streamed requests", registry=r
        )
        self.latency = Histogram("smcspec_request_seconds", "request wall time", registry=r)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()
        self._sd = [0, 0]  # drafts proposed, accepted
        r.register(_Live(self))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_choice(self, method: str, new_tokens: int, diagnostics: dict[str, Any]) -> None:
        """One finished choice: its tokens and its method's diagnostics."""
        self.tokens.labels(method).inc(new_tokens)
        with self._lock:
            self._recent.append((time.monotonic(), new_tokens))
            if method == "sd":
                self._sd[0] += diagnostics.get("proposed_tokens", 0)
                self._sd[1] += diagnostics.get("accepted_tokens", 0)
        if method == "smc":
            n = len(diagnostics.get("weights", [])) or 1
            ess = diagnostics.get("ess", [])
            self.smc_rounds.inc(len(ess))
            self.smc_resamples.inc(diagnostics.get("resamples", 0))
            for value in ess:
                self.smc_ess.observe(value / n)

    def recent_tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def sd_totals(self) -> tuple[int, int]:
        with self._lock:
            return self._sd[0], self._sd[1]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Collector of the values read at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, s = self.metrics, self.metrics.scheduler
        yield _gauge("smcspec_queue_length", "requests waiting for KV pages", s.queued)
        yield _gauge("smcspec_running_requests", "requests being decoded", s.running)
        yield _gauge(
            "smcspec_tokens_per_second",
            f"generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s",
            m.recent_tokens_per_second(),
        )
        used = GaugeMetricFamily("smcspec_kv_pages_in_use", "KV pages in use", labels=["model"])
        free = GaugeMetricFamily("smcspec_kv_pages_free", "KV pages free", labels=["model"])
        passes = CounterMetricFamily(
            "smcspec_forward_passes", "batched forward passes", labels=["model"]
        )
        rows = CounterMetricFamily(
            "smcspec_forward_rows", "sequences carried by the batched passes", labels=["model"]
        )
        seconds = CounterMetricFamily(
            "smcspec_forward_seconds", "time in batched forward passes", labels=["model"]
        )
        for i, name in enumerate(MODEL_NAMES[: len(s.models)]):
            pool = getattr(s.models[i], "pages", None)
            if pool is not None:
                used.add_metric([name], pool.used_pages)
                free.add_metric([name], pool.free_pages)
            passes.add_metric([name], s.stats.forwards[i])
            rows.add_metric([name], s.stats.rows[i])
            seconds.add_metric([name], s.stats.seconds[i])
        yield from (used, free, passes, rows, seconds)
        proposed, accepted = m.sd_totals()
        yield CounterMetricFamily("smcspec_sd_proposed_tokens", "sd drafts checked", proposed)
        yield CounterMetricFamily("smcspec_sd_accepted_tokens", "sd drafts accepted", accepted)
        yield _gauge(
            "smcspec_sd_acceptance_rate",
            "accepted / proposed drafts since start (sd)",
            accepted / proposed if proposed else 0.0,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
