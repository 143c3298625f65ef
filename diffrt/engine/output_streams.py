"""Per-request output streams: the one delivery path of every request.

The engine's threads (busy loop, post-processing pool) ``put`` outputs; the
consumer reads them either synchronously (``get``, used by ``generate``) or
from an asyncio loop (``aget``, used by ``step_streaming``), in which case
items cross into the loop with ``call_soon_threadsafe``. A stream whose loop
is gone reports ``put() -> False`` so the engine forgets it; that never
touches the request's lifecycle in the scheduler.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from diffrt.engine.outputs import DiffusionOutput


class OutputStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._sync: queue.SimpleQueue[DiffusionOutput] | None = None
        self._async: asyncio.Queue[DiffusionOutput] | None = None
        if loop is None:
            self._sync = queue.SimpleQueue()
        else:
            self._async = asyncio.Queue()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """The consumer is gone: later puts are refused."""
        self._closed.set()

    def put(self, output: DiffusionOutput) -> bool:
        """Deliver ``output``; False when the consumer is gone."""
        if self._closed.is_set():
            return False
        if self._sync is not None:
            self._sync.put(output)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, output)  # type: ignore[union-attr]
        except RuntimeError:  # the consumer's event loop is closed
            self._closed.set()
            return False
        return True

    def get(self, timeout: float | None = None) -> DiffusionOutput:
        """Blocking read (sync streams); raises queue.Empty on timeout."""
        if self._sync is None:
            raise RuntimeError("get() on an asyncio stream; use aget()")
        return self._sync.get(timeout=timeout)

    async def aget(self) -> DiffusionOutput:
        if self._async is None:
            raise RuntimeError("aget() on a synchronous stream; use get()")
        return await self._async.get()
