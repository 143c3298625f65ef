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
    ("diffrt_step_batch_rows", "step_batch_rows",
     "Rows of one denoise step (outputs, twice with CFG; step-batch execution)"),
    ("diffrt_step_batch_tokens", "step_batch_tokens",
     "Tokens one denoise step computed: each row's text and image tokens, summed "
     "(step-batch execution)"),
)


def _buckets(h: Any) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus' cumulative (le, count) pairs."""
    out, total = [], 0
    for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


#: (extra labels, an engine's stats snapshot) for every engine behind the server
Snapshots = Callable[[], list[tuple[dict[str, str], Any]]]


class EngineCollector(Collector):
    """One metric family per series, a sample per engine: one engine (no
    extra labels) behind ``diffrt serve``, one per replica (``replica="..."``)
    behind the Ray Serve application."""

    def __init__(self, snapshots: Snapshots):
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snapshots = self._snapshots()
        if not snapshots:  # the engine is still starting
            return
        names = sorted({key for labels, _ in snapshots for key in labels})

        def values(labels: dict[str, str]) -> list[str]:
            return [labels.get(name, "") for name in names]

        def gauge(name: str, help_text: str, read: Callable[[Any], float]) -> Metric:
            family = GaugeMetricFamily(name, help_text, labels=names)
            for labels, stats in snapshots:
                family.add_metric(values(labels), read(stats))
            return family

        def counter(name: str, help_text: str, read: Callable[[Any], float]) -> Metric:
            family = CounterMetricFamily(name, help_text, labels=names)
            for labels, stats in snapshots:
                family.add_metric(values(labels), read(stats))
            return family

        yield gauge("diffrt_sleeping", "1 while the engine sleeps (POST /sleep; requests wait)",
                    lambda s: float(s.sleeping))
        yield gauge("diffrt_requests_running", "Requests in a batch now",
                    lambda s: s.requests_running)
        yield gauge("diffrt_requests_waiting", "Requests accepted but not yet admitted to a batch",
                    lambda s: s.requests_waiting)
        total = CounterMetricFamily("diffrt_requests", "Finished requests by outcome",
                                    labels=[*names, "outcome"])
        for labels, stats in snapshots:
            for outcome, count in stats.requests_total.items():
                total.add_metric([*values(labels), outcome], count)
        yield total
        for name, field, help_text in HISTOGRAMS:
            family = HistogramMetricFamily(name, help_text, labels=names)
            for labels, stats in snapshots:
                h = getattr(stats, field)
                family.add_metric(values(labels), buckets=_buckets(h), sum_value=h.sum)
            yield family
        yield counter("diffrt_prompts_encoded", "Prompts run through the text encoders",
                      lambda s: s.text_encoding.encoded)
        yield counter("diffrt_prompt_cache_hits", "Prompts answered by the prompt-embedding "
                      "cache", lambda s: s.text_encoding.cache_hits)
        yield counter("diffrt_text_encode_seconds", "Seconds in the text encoders",
                      lambda s: s.text_encoding.seconds)
        yield gauge("diffrt_pending_output_bytes", "Finished outputs waiting for their "
                    "consumers", lambda s: s.pending_output_bytes)
        yield gauge("diffrt_engine_healthy", "1 while the engine is healthy",
                    lambda s: 1.0 if s.healthy else 0.0)
        yield counter("diffrt_worker_restarts", "Times fresh workers replaced dead or hung "
                      "ones", lambda s: s.worker_restarts)
        yield from self._loras(snapshots, names, values, gauge, counter)
        yield from self._caches(snapshots, names, values)
        yield from self._deadlines(snapshots, names, values, gauge, counter)
        yield gauge("diffrt_seconds_without_progress", "Seconds the worker call in flight "
                    "has gone without progress (0: none in flight)",
                    lambda s: s.seconds_without_progress)

    @staticmethod
    def _caches(snapshots: list[tuple[dict[str, str], Any]], names: list[str],
                values: Callable[[dict[str, str]], list[str]]) -> Iterator[Metric]:
        """The step caches: the denoise steps of finished requests that ran a
        cache, per policy and outcome (their ratio is the reuse rate), and the
        requests that asked for one but ran uncached, per reason."""
        steps = CounterMetricFamily("diffrt_cache_steps", "Denoise steps of finished requests "
                                    "that ran a step cache, computed or reused",
                                    labels=[*names, "policy", "outcome"])
        uncached = CounterMetricFamily("diffrt_cache_uncached_requests", "Requests that asked "
                                       "for a step cache but ran uncached, by reason",
                                       labels=[*names, "reason"])
        for labels, stats in snapshots:
            for (policy, outcome), count in sorted(stats.cache_steps_total.items()):
                steps.add_metric([*values(labels), policy, outcome], count)
            for reason, count in sorted(stats.cache_uncached_total.items()):
                uncached.add_metric([*values(labels), reason], count)
        yield steps
        yield uncached

    @staticmethod
    def _deadlines(snapshots: list[tuple[dict[str, str], Any]], names: list[str],
                   values: Callable[[dict[str, str]], list[str]],
                   gauge: Callable[..., Metric], counter: Callable[..., Metric]) -> Iterator[Metric]:
        """Deadlines and the ``slo`` policy's preemption: requests that had a
        deadline, per priority class and outcome ("met", "missed", "refused"), the
        running requests paused since start, those paused now and the step
        state they keep in the workers."""
        deadlines = CounterMetricFamily("diffrt_requests_deadline", "Requests with a "
                                        "deadline, by priority class and outcome (met, missed, "
                                        "refused at submission)",
                                        labels=[*names, "priority_class", "outcome"])
        for labels, stats in snapshots:
            for (priority, outcome), count in sorted(stats.requests_deadline_total.items()):
                deadlines.add_metric([*values(labels), priority, outcome], count)
        yield deadlines
        yield counter("diffrt_preemptions", "Running requests paused at a step boundary for "
                      "more urgent ones", lambda s: s.preemptions_total)
        yield gauge("diffrt_requests_paused", "Requests paused now, their step state kept in "
                    "the workers", lambda s: s.requests_paused)
        yield gauge("diffrt_paused_state_bytes", "Bytes of step state the paused requests "
                    "keep in the workers", lambda s: s.paused_state_bytes)
        yield from _step_cost(snapshots, names, values, counter)

    @staticmethod
    def _loras(snapshots: list[tuple[dict[str, str], Any]], names: list[str],
               values: Callable[[dict[str, str]], list[str]],
               gauge: Callable[..., Metric], counter: Callable[..., Metric]) -> Iterator[Metric]:
        """The LoRA adapters: registered, device slots, loads and evictions, and
        the requests accepted per adapter (``adapter`` label; a removed
        adapter's series ends with it)."""
        yield gauge("diffrt_loras_registered", "LoRA adapters registered now",
                    lambda s: s.loras_registered)
        yield gauge("diffrt_lora_slots_used", "Device slots holding a LoRA adapter now",
                    lambda s: s.lora_slots_used)
        yield gauge("diffrt_lora_slots", "Device slots for LoRA adapters (max_loras)",
                    lambda s: s.lora_slots)
        yield counter("diffrt_lora_loads", "LoRA adapters copied into a device slot",
                      lambda s: s.lora_loads_total)
        yield counter("diffrt_lora_evictions", "LoRA adapters evicted from a device slot "
                      "for another one", lambda s: s.lora_evictions_total)
        per_adapter = CounterMetricFamily("diffrt_lora_requests", "Requests accepted with "
                                          "each LoRA adapter", labels=[*names, "adapter"])
        for labels, stats in snapshots:
            for adapter, count in sorted(stats.lora_requests_total.items()):
                per_adapter.add_metric([*values(labels), adapter], count)
        yield per_adapter


def _step_cost(snapshots: list[tuple[dict[str, str], Any]], names: list[str],
               values: Callable[[dict[str, str]], list[str]],
               counter: Callable[..., Metric]) -> Iterator[Metric]:
    """The step-cost model: its coefficients per term (online and idle), its
    recent relative prediction error (median, p90) and the share decisions."""
    coefficients = GaugeMetricFamily("diffrt_step_cost_coefficient", "The step-cost model's "
                                     "seconds per unit of each term (online: fitted from "
                                     "ticks; idle: what limits are judged by)",
                                     labels=[*names, "model", "term"])
    error = GaugeMetricFamily("diffrt_step_cost_error", "Recent |measured - predicted| / "
                              "measured of a tick", labels=[*names, "quantile"])
    for labels, stats in snapshots:
        for model, fit in (("online", stats.step_cost), ("idle", stats.step_cost_idle)):
            for term, value in sorted(fit.items()):
                coefficients.add_metric([*values(labels), model, term], value)
        if stats.step_cost_error is not None:
            for quantile, value in zip(("0.5", "0.9"), stats.step_cost_error, strict=True):
                error.add_metric([*values(labels), quantile], value)
    yield coefficients
    yield error
    yield counter("diffrt_steps_shared", "Requests of another size, adapters or cache that "
                  "joined a running step (the step-cost model's decision)",
                  lambda s: s.steps_shared_total)
    yield counter("diffrt_steps_split", "Requests of another kind kept apart from a running "
                  "step (the step-cost model's decision)", lambda s: s.steps_split_total)


#: (name, usage key, help) of the url image store's gauges
URL_STORE_GAUGES = (
    ("diffrt_url_images", "images", 'response_format="url" images kept'),
    ("diffrt_url_image_bytes", "bytes", "Bytes of the url images kept"),
    ("diffrt_url_images_reserved", "reserved_images",
     "url images of requests in flight (room taken at submission)"),
    ("diffrt_url_image_bytes_reserved", "reserved_bytes",
     "Estimated bytes of the url images of requests in flight"),
    ("diffrt_url_images_max", "max_images", "The most url images kept"),
    ("diffrt_url_image_bytes_max", "max_bytes", "The most bytes of url images kept"),
    ("diffrt_url_image_ttl_seconds", "ttl_seconds", "Seconds a url image is kept"),
)


#: the same of the rollout store's (``rollout_store.py``)
ROLLOUT_STORE_GAUGES = (
    ("diffrt_rollouts", "images", "Rollout downloads kept (GET /v1/rollouts/{id})"),
    ("diffrt_rollout_bytes", "bytes", "Bytes of the rollout downloads kept"),
    ("diffrt_rollouts_reserved", "reserved_images",
     "Rollouts of requests in flight (room taken at submission)"),
    ("diffrt_rollout_bytes_reserved", "reserved_bytes",
     "Estimated bytes of the rollouts of requests in flight"),
    ("diffrt_rollout_bytes_max", "max_bytes", "The most bytes of rollouts kept"),
    ("diffrt_rollout_ttl_seconds", "ttl_seconds", "Seconds a rollout is kept"),
)


class UrlStoreCollector(Collector):
    """A store's use and bounds (``ImageStore.usage``) as ``gauges`` name
    them: the url image store's, or the rollout store's."""

    def __init__(self, usage: Callable[[], dict[str, float]], labels: dict[str, str],
                 gauges: tuple[tuple[str, str, str], ...] = URL_STORE_GAUGES):
        self._usage, self._labels, self._gauges = usage, labels, gauges

    def collect(self) -> Iterator[Metric]:
        usage = self._usage()
        for name, key, help_text in self._gauges:
            family = GaugeMetricFamily(name, help_text, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), usage[key])
            yield family


class ServerMetrics:
    """The registry /metrics exposes: the engines' metrics, the url image and
    rollout stores and the HTTP answers (labelled with the serving process's ``replica`` when
    it is one of several)."""

    def __init__(self, snapshots: Snapshots, replica: str | None = None,
                 url_store: Callable[[], dict[str, float]] | None = None,
                 rollout_store: Callable[[], dict[str, float]] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshots))
        store_labels = {} if replica is None else {"replica": replica}
        if url_store is not None:
            self.registry.register(UrlStoreCollector(url_store, store_labels))
        if rollout_store is not None:
            self.registry.register(UrlStoreCollector(rollout_store, store_labels,
                                                     ROLLOUT_STORE_GAUGES))
        label_names = ["code"] if replica is None else ["code", "replica"]
        counter = Counter("diffrt_http_responses", "HTTP responses by status code", label_names,
                          registry=self.registry)
        self._counter, self._replica = counter, replica

    def count_response(self, code: int) -> None:
        if self._replica is None:
            self._counter.labels(str(code)).inc()
        else:
            self._counter.labels(str(code), self._replica).inc()
