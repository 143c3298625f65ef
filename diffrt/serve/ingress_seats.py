"""The Ray ingress's seats among the waiting: ``max_pending`` over every replica.

With replicas (``ray_app.py``) a request waits first in Ray's handle queue,
in the ingress, then perhaps in a replica's engine (a step batch of another
size cannot take it yet); each engine counts only its own queue, and the
board's statistics are a second old. So the single ingress holds the bound:
it takes a seat when it accepts a request (``WaitingSeats.take``, at once,
under a lock) and gives it back when the replica reports that its engine
admitted the request to the running set (the ``ADMITTED`` item a replica's
stream carries, ``announce_admission``) or when the call ends first (an
error, a shed, a client gone). The requests waiting anywhere in the
application then never exceed ``max_pending``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

#: the item a replica's stream carries when its engine admitted the request
ADMITTED = "admitted"


def is_admitted(item: Any) -> bool:
    return isinstance(item, str) and item == ADMITTED


class IngressSeat:
    """One accepted request's place; ``release`` is idempotent."""

    def __init__(self, seats: WaitingSeats):
        self._seats: WaitingSeats | None = seats

    def release(self) -> None:
        seats, self._seats = self._seats, None
        if seats is not None:
            seats._give_back()


class WaitingSeats:
    """At most ``limit`` requests accepted and not yet admitted."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._taken = 0

    @property
    def taken(self) -> int:
        """Requests accepted and not yet admitted (or ended)."""
        return self._taken

    def take(self) -> IngressSeat | None:
        """A seat, or None when ``limit`` are taken (the request is shed)."""
        with self._lock:
            if self._taken >= self.limit:
                return None
            self._taken += 1
        return IngressSeat(self)

    def _give_back(self) -> None:
        with self._lock:
            self._taken -= 1


async def announce_admission(outputs: AsyncIterator[Any],
                             admitted: asyncio.Event) -> AsyncIterator[Any]:
    """``outputs``, with ``ADMITTED`` first as soon as ``admitted`` is set
    (also while no output comes: a request-batch forward yields only its
    final output). Leaving early cancels the pending item and closes
    ``outputs`` (which aborts the request in the engine)."""
    told = False
    try:
        while True:
            item = asyncio.ensure_future(outputs.__anext__())
            try:
                if not told:
                    flag = asyncio.ensure_future(admitted.wait())
                    try:
                        await asyncio.wait({item, flag}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        flag.cancel()
                    if admitted.is_set():
                        told = True
                        yield ADMITTED
                try:
                    out = await item
                except StopAsyncIteration:
                    return
            finally:
                if not item.done():
                    item.cancel()
                    with contextlib.suppress(BaseException):
                        await item
            yield out
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["ADMITTED", "IngressSeat", "WaitingSeats", "announce_admission", "is_admitted"]
