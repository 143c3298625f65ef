"""Per-request samples of a bench run and the figures printed from them.

Every percentile and median that `diffrt bench` and the scripts in
benchmarks/ print comes from ``percentile`` / ``median`` here (numpy's linear
interpolation), so a p50 means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Sample:
    """What one request of a bench run measured (seconds)."""

    latency: float
    ok: bool
    images: int = 0
    queue_wait: float | None = None
    forward_time: float | None = None
    output_wait: float | None = None
    postprocess_time: float | None = None
    #: why the request failed (None when it succeeded)
    error: str | None = None
    #: the HTTP status (HTTP targets; 0 when no answer came; None in-process)
    status: int | None = None
    #: the request's latency target (``SamplingParams.deadline_s``; None: none)
    deadline: float | None = None

    @property
    def in_time(self) -> bool:
        """It succeeded within its deadline."""
        return self.ok and self.deadline is not None and self.latency <= self.deadline

    @classmethod
    def from_output(cls, latency: float, output: Any) -> Sample:
        if output is None:
            return cls(latency=latency, ok=False, error="the stream ended without a final output")
        m = output.metrics
        return cls(latency=latency, ok=output.ok, images=len(output.images or []) if output.ok else 0,
                   queue_wait=m.queue_wait, forward_time=m.forward_time,
                   output_wait=m.output_wait, postprocess_time=m.postprocess_time,
                   error=None if output.ok else (output.error or "aborted"))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``.

    Args:
        values: the samples, in any order.
        q: the percentile, 50 for the median.

    Returns:
        ``numpy.percentile`` with its default linear interpolation, as a float;
        None when there are no values.
    """
    if len(values) == 0:
        return None
    import numpy as np  # here, not at the top: `diffrt --help` stays quick

    return float(np.percentile(values, q))


def median(values: Sequence[float]) -> float | None:
    """The 50th ``percentile`` of ``values``; None when there are none."""
    return percentile(values, 50)


def _mean_ms(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return 1000.0 * sum(present) / len(present) if present else None


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """Throughput and goodput over the whole run; latency percentiles and mean
    phase times over the requests that succeeded; the share of the requests
    with a deadline that met it (a failed one missed it)."""
    ok = [s for s in samples if s.ok]
    lat = [s.latency * 1000.0 for s in ok]
    by_status: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            key = ("error" if s.status is None  # in-process: the engine's error
                   else "no answer" if s.status == 0 else str(s.status))
            by_status[key] = by_status.get(key, 0) + 1
    with_deadline = [s for s in samples if s.deadline is not None]
    in_time = sum(s.in_time for s in with_deadline)
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "failed_by_status": dict(sorted(by_status.items())),
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
        "images_per_s": sum(s.images for s in ok) / wall_s if wall_s > 0 else None,
        "latency_p50_ms": median(lat),
        "latency_p90_ms": percentile(lat, 90),
        "latency_p99_ms": percentile(lat, 99),
        "latency_mean_ms": sum(lat) / len(lat) if lat else None,
        "queue_wait_ms": _mean_ms([s.queue_wait for s in ok]),
        "forward_ms": _mean_ms([s.forward_time for s in ok]),
        "output_wait_ms": _mean_ms([s.output_wait for s in ok]),
        "postprocess_ms": _mean_ms([s.postprocess_time for s in ok]),
        # goodput: requests that finished within their deadline, per second
        # (None when no request had one)
        "goodput_rps": in_time / wall_s if with_deadline and wall_s > 0 else None,
        "deadlines_met": in_time / len(with_deadline) if with_deadline else None,
    }


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base
