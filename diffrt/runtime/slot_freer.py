"""Returning shared-memory slots to the worker that wrote them.

A slot is freed when its lease goes, which may be a GC finalizer on any
thread at any moment: the freer only appends and never blocks on a lock, and
whoever holds the lock (or the pump's periodic flush) sends the batch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from diffrt.runtime.messages import FreeSlots

logger = logging.getLogger(__name__)


class SlotFreer:
    """Returns slots to the writer. ``post`` may run from a GC finalizer on any
    thread at any moment, so it only appends and never blocks on a lock."""

    def __init__(self, sink: Callable[[FreeSlots], None]):
        self._sink = sink
        self._pending: deque[tuple[int, int]] = deque()
        self._ids: deque[str] = deque()
        self._lock = threading.Lock()
        self.closed = False

    def post(self, offset: int, generation: int) -> None:
        self._pending.append((offset, generation))
        self.flush()

    def post_id(self, output_id: str) -> None:
        """Free by id (sent with the next flush; the pump flushes periodically)."""
        self._ids.append(output_id)

    def flush(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the holder (or a periodic flush) sends it
        try:
            while (self._pending or self._ids) and not self.closed:
                msg = FreeSlots(_drain(self._pending), _drain(self._ids))
                try:
                    self._sink(msg)
                except Exception:  # writer gone: nothing left to free
                    logger.debug("could not return slots", exc_info=True)
                    self.closed = True
        finally:
            self._lock.release()


def _drain(q: deque) -> list:
    out = []
    while q:
        out.append(q.popleft())
    return out


def releaser(freer: SlotFreer, offset: int, generation: int, oid: str,
              done: deque[str]) -> Callable[[], None]:
    """The release of output ``oid``'s slot, for its lease's finalizer: the slot
    back to the writer and ``oid`` noted in ``done``."""
    # A closure over plain values: the lease's finalizer must not reference the lease.
    def release() -> None:
        freer.post(offset, generation)
        done.append(oid)
    return release
