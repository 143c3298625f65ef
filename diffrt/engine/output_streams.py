"""Per-request output streams, and the final output that waits in shared memory.

The engine's threads ``put`` items; the consumer reads them synchronously
from an inbox (``(request_id, item)`` pairs; ``generate`` gives all its
streams one inbox and takes outputs as they finish) or from an asyncio loop (``aget``; items cross into the loop with
``call_soon_threadsafe``). An item is a progress ``DiffusionOutput`` or, last,
either a final ``DiffusionOutput`` (errors, aborts) or a ``FinalSlot``.

A ``FinalSlot`` holds a finished request's output where the worker wrote it,
in the shared-memory arena, until the consumer takes it: only then is it
post-processed (to PIL) and its slot freed. So outputs nobody reads stay in
the arena, whose size bounds them (a full arena throttles the worker), never
pile up in the engine's own memory. A slot can also expire (unread for too
long, its consumer gone, the engine closing): its lease is freed and the
consumer, if it ever reads, gets the error instead.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Union

from diffrt.engine.outputs import DiffusionOutput
from diffrt.runtime.shm_transport import OutputLease


class FinalSlot:
    """One finished output in shared memory; exactly one of ``take`` and
    ``expire`` decides the final ``DiffusionOutput``."""

    def __init__(self, request_id: str, lease: OutputLease,
                 complete: Callable[[OutputLease], DiffusionOutput], ready_at: float,
                 stream: OutputStream):
        self.request_id = request_id
        self.ready_at = ready_at
        #: the stream it was delivered to (its consumer leaving frees it)
        self.stream = stream
        self._lease: OutputLease | None = lease
        self._complete = complete
        self._output: DiffusionOutput | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        lease = self._lease
        return lease.nbytes if lease is not None else 0

    def take(self) -> DiffusionOutput:
        """Post-process and free the output (first call); the same output after."""
        with self._lock:
            if self._output is None:
                lease, self._lease = self._lease, None
                assert lease is not None
                self._output = self._complete(lease)
            return self._output

    def expire(self, output: DiffusionOutput) -> bool:
        """Free the output unread; ``output`` is what a later ``take`` returns.
        False when it was taken already or is being taken right now (never
        waits for a take in progress, so it is safe under the engine's locks)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._output is not None:
                return False
            lease, self._lease = self._lease, None
            self._output = output
        finally:
            self._lock.release()
        if lease is not None:
            lease.release()
        return True


StreamItem = Union[DiffusionOutput, FinalSlot]  # noqa: UP007  (a runtime alias)


def resolve(item: StreamItem) -> DiffusionOutput:
    """The output an item stands for (takes a FinalSlot: call it once you want it)."""
    return item.take() if isinstance(item, FinalSlot) else item


class OutputStream:
    """Where one request's outputs go while its consumer listens."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None,
                 inbox: queue.SimpleQueue | None = None):
        self.request_id = request_id
        self._loop = loop
        self._inbox: queue.SimpleQueue[tuple[str, StreamItem]] | None = None
        self._async: asyncio.Queue[StreamItem] | None = None
        if loop is None:
            self._inbox = inbox if inbox is not None else queue.SimpleQueue()
        else:
            self._async = asyncio.Queue()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """The consumer is gone: later puts are refused."""
        self._closed.set()

    def put(self, item: StreamItem) -> bool:
        """Deliver ``item``; False when the consumer is gone."""
        if self._closed.is_set():
            return False
        if self._inbox is not None:
            self._inbox.put((self.request_id, item))
            return True
        assert self._loop is not None and self._async is not None  # no inbox: a loop's stream
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed
            self._closed.set()
            return False
        return True

    async def aget(self) -> StreamItem:
        if self._async is None:
            raise RuntimeError("aget() on a synchronous stream; read its inbox")
        return await self._async.get()


__all__ = ["FinalSlot", "OutputStream", "StreamItem", "resolve"]
