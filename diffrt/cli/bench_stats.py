"""Per-request samples of a bench run and the figures printed from them."""

from __future__ import annotations

import math
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

    @classmethod
    def from_output(cls, latency: float, output: Any) -> Sample:
        if output is None:
            return cls(latency=latency, ok=False)
        m = output.metrics
        return cls(latency=latency, ok=output.ok, images=len(output.images or []) if output.ok else 0,
                   queue_wait=m.queue_wait, forward_time=m.forward_time,
                   output_wait=m.output_wait, postprocess_time=m.postprocess_time)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (as numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean_ms(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return 1000.0 * sum(present) / len(present) if present else None


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """Throughput over the whole run; latency percentiles and mean phase times
    over the requests that succeeded."""
    ok = [s for s in samples if s.ok]
    lat = [s.latency * 1000.0 for s in ok]
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
        "images_per_s": sum(s.images for s in ok) / wall_s if wall_s > 0 else None,
        "latency_p50_ms": percentile(lat, 50),
        "latency_p90_ms": percentile(lat, 90),
        "latency_p99_ms": percentile(lat, 99),
        "latency_mean_ms": sum(lat) / len(lat) if lat else None,
        "queue_wait_ms": _mean_ms([s.queue_wait for s in ok]),
        "forward_ms": _mean_ms([s.forward_time for s in ok]),
        "output_wait_ms": _mean_ms([s.output_wait for s in ok]),
        "postprocess_ms": _mean_ms([s.postprocess_time for s in ok]),
    }


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base
