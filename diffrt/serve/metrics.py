"""Prometheus metrics, read from ``engine.stats()`` when scraped.

A custom collector turns the engine's snapshot into metric families (gauges,
counters, histograms with cumulative ``le`` buckets), so the engine depends on
no metrics library and a scrape never walks engine internals. The server's own
count of HTTP answers by status sits next to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

HISTOGRAMS = (
    ("diffrt_request_latency_seconds", "request_latency_s",
     "Arrival to final output, per finished request"),
    ("diffrt_queue_wait_seconds", "queue_wait_s", "Arrival to the first batch, per request"),
    ("diffrt_step_seconds", "step_time_s", "One denoise step of a batch"),
    ("diffrt_output_wait_seconds", "output_wait_s",
     "Compute done to the output in host memory, per request"),
)


def _buckets(h: Any) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus' cumulative (le, count) pairs."""
    out, total = [], 0
    for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # the engine is still starting
            return
        yield GaugeMetricFamily("diffrt_requests_running", "Requests in a batch now",
                                value=stats.requests_running)
        yield GaugeMetricFamily("diffrt_requests_waiting",
                                "Requests admitted but not yet in a batch",
                                value=stats.requests_waiting)
        total = CounterMetricFamily("diffrt_requests", "Finished requests by outcome",
                                    labels=["outcome"])
        for outcome, count in stats.requests_total.items():
            total.add_metric([outcome], count)
        yield total
        for name, field, help_text in HISTOGRAMS:
            h = getattr(stats, field)
            yield HistogramMetricFamily(name, help_text, buckets=_buckets(h), sum_value=h.sum)
        text = stats.text_encoding
        yield CounterMetricFamily("diffrt_prompts_encoded", "Prompts run through the text "
                                  "encoders", value=text.encoded)
        yield CounterMetricFamily("diffrt_prompt_cache_hits", "Prompts answered by the "
                                  "prompt-embedding cache", value=text.cache_hits)
        yield CounterMetricFamily("diffrt_text_encode_seconds", "Seconds in the text encoders",
                                  value=text.seconds)
        yield GaugeMetricFamily("diffrt_pending_output_bytes",
                                "Finished outputs waiting for their consumers",
                                value=stats.pending_output_bytes)
        yield GaugeMetricFamily("diffrt_engine_healthy", "1 while the engine is healthy",
                                value=1.0 if stats.healthy else 0.0)
        yield CounterMetricFamily("diffrt_worker_restarts", "Times fresh workers replaced "
                                  "dead or hung ones", value=stats.worker_restarts)


class ServerMetrics:
    """The registry /metrics exposes: the engine's metrics and the HTTP answers."""

    def __init__(self, stats: Callable[[], Any]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        self.responses = Counter("diffrt_http_responses", "HTTP responses by status code",
                                 ["code"], registry=self.registry)
