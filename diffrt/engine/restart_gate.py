"""RestartGate: where a submission made while fresh workers start waits for them.

With ``restart_workers`` a dead executor is replaced on the engine loop's
thread, which takes seconds (spawn, import, load, warm up). A request submitted
meanwhile is queued like any other (it stays in the scheduler's waiting set,
so ``stats().requests_waiting`` counts it and an abort finds it), and its
submitter waits here until the restart ends, one way or the other, or until
its own bound; the engine then serves it, refuses it (``EngineRestartingError``)
or reports the dead engine (``EngineDeadError``).

The core wakes every waiter when a restart ends (fresh workers, given up) and
when it stops; a waiter also looks again every ``RECHECK_S``, so a missed wake
costs at most that much. Threads wait on a ``threading.Event``; coroutines on
an ``asyncio.Event`` set through their loop's ``call_soon_threadsafe``, so a
held request never blocks its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

#: how often a waiter looks again without being woken (a safety net)
RECHECK_S = 0.5


class RestartGate:
    """Waiters and their wake-up calls; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakers: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()

    def wake(self) -> None:
        """Something a waiter waits for may have changed (a restart ended, the
        core stopped, a held request was aborted): every waiter looks again."""
        with self._lock:
            wakers = list(self._wakers.values())
        for wake in wakers:
            wake()

    @contextlib.contextmanager
    def _registered(self, wake: Callable[[], None]) -> Iterator[None]:
        key = next(self._ids)
        with self._lock:
            self._wakers[key] = wake
        try:
            yield
        finally:
            with self._lock:
                del self._wakers[key]

    def wait(self, holding: Callable[[], bool], until: float,
             clock: Callable[[], float]) -> bool:
        """Block the calling thread while ``holding()`` is true, at most until
        ``until`` (``clock``'s time). True when it stopped holding, False at
        ``until`` while it still holds."""
        woken = threading.Event()
        with self._registered(woken.set):
            while True:
                woken.clear()  # before looking: a wake from now on is kept
                if not holding():
                    return True
                remaining = until - clock()
                if remaining <= 0:
                    return False
                woken.wait(min(remaining, RECHECK_S))

    async def wait_async(self, holding: Callable[[], bool], until: float,
                         clock: Callable[[], float]) -> bool:
        """``wait`` for a coroutine: the event loop runs on meanwhile."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # from the core's threads
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(woken.set)

        with self._registered(wake):
            while True:
                woken.clear()
                if not holding():
                    return True
                remaining = until - clock()
                if remaining <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(remaining, RECHECK_S))


__all__ = ["RECHECK_S", "RestartGate"]
