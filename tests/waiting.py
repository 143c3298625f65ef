"""Polling for a condition another thread or process brings about.

The one ``wait_until`` of the test suite (and ``wait_for``, its twin for
coroutines); every test folder imports them as ``from waiting import
wait_until`` (pyproject puts tests/ on ``sys.path``). Tests wait for the event
that matters, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds a wait gives its condition unless told otherwise: what the tests
#: wait for takes well under a second on a quiet machine, and a machine other
#: processes keep busy may take many times that; a bound only ends a wait
#: that has failed, so it is generous
DEFAULT_TIMEOUT_S = 60.0

#: seconds a whole subprocess (a CLI run, a server start) may take before a
#: test gives up on it: a guard against a hang, never a measure of speed. A
#: 40 s CLI run took 11 minutes with the machine 17 times oversubscribed, so
#: the guard is far above any speed the suite can meet; CI's own limit ends a
#: true hang anyway
HANG_GUARD_S = 1200.0


def wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.01,
               message: str | Callable[[], Any] | None = None) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true.

    Args:
        predicate: a cheap check, or one step towards the condition that
            records what it saw (a request whose answer counts): it is
            called once more after the timeout, and a call is not cut short.
        timeout: seconds to keep trying; the predicate is called once more at the end.
        interval: seconds between calls.
        message: what the AssertionError says on timeout; a callable is called
            then, so it can show the state at that moment (e.g. counters).

    Returns:
        The predicate's first true value, so ``assert wait_until(...)`` reads naturally.

    Raises:
        AssertionError: the predicate was still false after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return _last_try(predicate, timeout, message)


async def wait_for(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.01,
                   message: str | Callable[[], Any] | None = None) -> T:
    """``wait_until`` inside a coroutine: polls without blocking the event loop,
    so the loop keeps serving the streams whose progress the predicate watches.

    Args, Returns and Raises as for ``wait_until``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    return _last_try(predicate, timeout, message)


def _last_try(predicate: Callable[[], T], timeout: float,
              message: str | Callable[[], Any] | None) -> T:
    value = predicate()
    if value:
        return value
    text = message() if callable(message) else message
    name = getattr(predicate, "__qualname__", repr(predicate))
    raise AssertionError(f"{text or 'condition not met'} (waited {timeout:g} s for {name})")
