"""The load a bench run puts on a target: closed loop (fixed concurrency) or
open loop (Poisson arrivals at a given rate).

A target runs one request and measures it (``run_request(request) -> Sample``):
``EngineTarget`` through an in-process engine's ``step_streaming``,
``HttpTarget`` (``http_target.py``) through a running server's API. Both see
the same load, so their figures compare."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from diffrt.cli.bench_stats import Sample


class EngineTarget:
    """An in-process engine as a load target."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def run_request(self, request: Any) -> Sample:
        from diffrt.engine.errors import EngineError
        from diffrt.engine.sampling import InvalidRequestError

        start = time.perf_counter()
        final = None
        try:
            async for output in self.engine.step_streaming(request):
                if output.finished:
                    final = output
        except (EngineError, InvalidRequestError) as exc:  # refused: a failed sample, not a crash
            return Sample(latency=time.perf_counter() - start, ok=False,
                          error=f"refused: {type(exc).__name__}: {exc}")
        return Sample.from_output(time.perf_counter() - start, final)

    async def aclose(self) -> None:
        pass


async def _measured(target: Any, request: Any) -> Sample:
    """``request`` run on ``target``, its sample carrying the request's
    deadline (a request without sampling parameters has none)."""
    sample = await target.run_request(request)
    sample.deadline = getattr(getattr(request, "sampling_params", None), "deadline_s", None)
    return sample


async def _closed_loop(target: Any, requests: list[Any], concurrency: int) -> list[Sample]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(request: Any) -> Sample:
        async with gate:
            return await _measured(target, request)

    return list(await asyncio.gather(*(guarded(r) for r in requests)))


async def _open_loop(target: Any, requests: list[Any], rate: float, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    tasks = []
    for i, request in enumerate(requests):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(_measured(target, request)))
    return list(await asyncio.gather(*tasks))


def drive(target: Any, requests: list[Any], *, concurrency: int, rate: float | None,
          seed: int = 0) -> tuple[list[Sample], float]:
    """Run every request to its end on ``target`` (an ``EngineTarget`` or an
    ``HttpTarget``); return the samples and the wall time (s)."""

    async def main() -> tuple[list[Sample], float]:
        start = time.perf_counter()
        try:
            if rate:
                samples = await _open_loop(target, requests, rate, seed)
            else:
                samples = await _closed_loop(target, requests, concurrency)
        finally:
            await target.aclose()
        return samples, time.perf_counter() - start

    return asyncio.run(main())
