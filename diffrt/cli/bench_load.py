"""The load a bench run puts on an engine: closed loop (fixed concurrency) or
open loop (Poisson arrivals at a given rate), all through `step_streaming`."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from diffrt.cli.bench_stats import Sample


async def _one(engine: Any, request: Any) -> Sample:
    start = time.perf_counter()
    final = None
    async for output in engine.step_streaming(request):
        if output.finished:
            final = output
    return Sample.from_output(time.perf_counter() - start, final)


async def _closed_loop(engine: Any, requests: list[Any], concurrency: int) -> list[Sample]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(request: Any) -> Sample:
        async with gate:
            return await _one(engine, request)

    return list(await asyncio.gather(*(guarded(r) for r in requests)))


async def _open_loop(engine: Any, requests: list[Any], rate: float, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    tasks = []
    for i, request in enumerate(requests):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(_one(engine, request)))
    return list(await asyncio.gather(*tasks))


def drive(engine: Any, requests: list[Any], *, concurrency: int, rate: float | None,
          seed: int = 0) -> tuple[list[Sample], float]:
    """Run every request to its end; return the samples and the wall time (s)."""

    async def main() -> tuple[list[Sample], float]:
        start = time.perf_counter()
        if rate:
            samples = await _open_loop(engine, requests, rate, seed)
        else:
            samples = await _closed_loop(engine, requests, concurrency)
        return samples, time.perf_counter() - start

    return asyncio.run(main())
