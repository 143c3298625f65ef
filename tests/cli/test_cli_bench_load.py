"""The bench load driver against a fake engine: concurrency bound, open loop, samples."""

from __future__ import annotations

import asyncio

from diffrt.cli.bench_load import EngineTarget, drive
from diffrt.engine.outputs import DiffusionOutput, RequestMetrics


class FakeEngine:
    """Streams two progress outputs and a final one per request; counts what is in flight."""

    def __init__(self, fail: set[str] = frozenset()):
        self.in_flight = 0
        self.peak = 0
        self.seen: list[str] = []
        self.fail = fail

    async def step_streaming(self, request):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.seen.append(request)
        try:
            for step in (1, 2):
                await asyncio.sleep(0.002)
                yield DiffusionOutput(request, step=step, total_steps=2)
            error = "boom" if request in self.fail else None
            yield DiffusionOutput(request, finished=True, step=2, total_steps=2, error=error,
                                  images=None if error else ["img"],
                                  metrics=RequestMetrics(queue_wait=0.001, forward_time=0.004))
        finally:
            self.in_flight -= 1


def test_closed_loop_keeps_at_most_concurrency_in_flight():
    engine = FakeEngine(fail={"r3"})
    requests = [f"r{i}" for i in range(10)]
    samples, wall = drive(EngineTarget(engine), requests, concurrency=3, rate=None)
    assert engine.peak == 3 and sorted(engine.seen) == sorted(requests)
    assert len(samples) == 10 and wall > 0
    assert [s.ok for s in samples].count(False) == 1 and not samples[3].ok
    assert all(s.latency >= 0.004 for s in samples)
    assert samples[0].images == 1 and samples[0].forward_time == 0.004


def test_open_loop_arrivals_do_not_wait_for_earlier_requests():
    # Poisson arrivals at 10000/s (mean gap 0.1 ms) against 4 ms requests: an
    # open loop lets them pile up, whatever the concurrency setting says.
    engine = FakeEngine()
    samples, _ = drive(EngineTarget(engine), [f"r{i}" for i in range(6)], concurrency=1, rate=10000.0, seed=1)
    assert len(samples) == 6 and all(s.ok for s in samples)
    assert engine.peak > 1
