"""What people run without diffrt, as load targets for the benchmarks: one
diffusers pipeline behind a lock, or behind a static batcher.

Both take ``call(pipe, ids, *key)``, which runs the requests ``ids`` that
share ``key`` (their shape: size and steps) in one pipeline call, and are
driven from an asyncio loop (``await peer.run(i, *key)``); the pipeline call
runs in a thread, one at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Call = Callable[..., None]


class SerialPeer:
    """diffusers behind a lock: one request at a time, in arrival order."""

    def __init__(self, pipe: Any, call: Call) -> None:
        self.pipe, self.call, self.lock = pipe, call, asyncio.Lock()

    async def run(self, i: int, *key: int) -> None:
        async with self.lock:
            await asyncio.to_thread(self.call, self.pipe, [i], *key)


class StaticBatcherPeer:
    """Groups requests by their key; a group runs when it has ``batch``
    requests or its oldest waited ``wait_s``; one pipeline call at a time, the
    oldest due group first."""

    def __init__(self, pipe: Any, call: Call, batch: int, wait_s: float = 2.0) -> None:
        self.pipe, self.call, self.batch, self.wait_s = pipe, call, batch, wait_s
        self.groups: dict[tuple[int, ...], list[tuple[float, int, asyncio.Future]]] = (
            defaultdict(list))
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def run(self, i: int, *key: int) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._loop())
        fut = asyncio.get_running_loop().create_future()
        self.groups[key].append((time.perf_counter(), i, fut))
        self.wake.set()
        await fut

    def _due(self) -> tuple[int, ...] | None:
        now = time.perf_counter()
        due = [(items[0][0], key) for key, items in self.groups.items()
               if items and (len(items) >= self.batch or now - items[0][0] >= self.wait_s)]
        return min(due)[1] if due else None

    async def _loop(self) -> None:
        while True:
            key = self._due()
            if key is None:
                self.wake.clear()
                oldest = [items[0][0] for items in self.groups.values() if items]
                timeout = (max(0.0, min(oldest) + self.wait_s - time.perf_counter())
                           if oldest else None)
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            items = self.groups[key][:self.batch]
            del self.groups[key][:self.batch]
            await asyncio.to_thread(self.call, self.pipe, [i for _, i, _ in items], *key)
            for _, _, fut in items:
                fut.set_result(None)
