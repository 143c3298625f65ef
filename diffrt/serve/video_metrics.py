"""The videos' metrics: jobs by outcome (``diffrt_videos_total``), the
seconds each clip's files took to encode, and the job store's bytes
(``VideoStore.usage``), in the server's registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: the outcomes a job ends with
OUTCOMES = ("completed", "failed", "deleted")
#: encode seconds' buckets: a tiny clip's milliseconds to a long 720p clip's minute
ENCODE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _StoreCollector(Collector):
    def __init__(self, usage: Callable[[], dict[str, float]]):
        self._usage = usage

    def collect(self) -> Iterator[Metric]:
        usage = self._usage()
        yield GaugeMetricFamily("diffrt_video_store_bytes",
                                "bytes the video jobs hold (files and reservations)",
                                value=usage["bytes"])
        yield GaugeMetricFamily("diffrt_video_store_max_bytes", "the video store's bound",
                                value=usage["max_bytes"])
        jobs = GaugeMetricFamily("diffrt_video_jobs", "video jobs kept, by status",
                                 labels=["status"])
        for status in ("queued", "in_progress", "completed", "failed"):
            jobs.add_metric([status], usage[f"jobs_{status}"])
        yield jobs


class VideoMetrics:
    def __init__(self, registry: CollectorRegistry, usage: Callable[[], dict[str, float]]):
        self._jobs = Counter("diffrt_videos", "video jobs by outcome", ["outcome"],
                             registry=registry)
        for outcome in OUTCOMES:
            self._jobs.labels(outcome)
        self._encode = Histogram("diffrt_video_encode_seconds",
                                 "seconds to encode a clip's files (MP4, thumbnail, "
                                 "spritesheet)", buckets=ENCODE_BUCKETS, registry=registry)
        registry.register(_StoreCollector(usage))

    def count(self, outcome: str) -> None:
        self._jobs.labels(outcome).inc()

    def encoded(self, seconds: float) -> None:
        self._encode.observe(seconds)


__all__ = ["OUTCOMES", "VideoMetrics"]
