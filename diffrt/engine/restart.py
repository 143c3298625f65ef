"""WorkerRestart: fresh workers after the old ones died (``restart_workers``).

The engine loop runs it when it finds the executor unhealthy: the requests
that were running fail (their state died with the workers), the old executor
is shut down, and fresh workers are started — a bounded number of attempts,
with a doubling back-off between failed ones — to serve the requests still
waiting. Submissions made meanwhile wait at ``gate`` (``restart_gate.py``)
and are woken when the restart ends, whichever way.

The core lends it what only the core may touch, as callables: failing the
running requests and swapping the executor in happen under the core's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diffrt.engine.restart_gate import RestartGate
from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)

#: With restarts on, how often an idle loop looks at the workers' health.
RESTART_CHECK_S = 0.5
#: The first wait after a failed restart attempt (doubling each time).
RESTART_BACKOFF_S = 1.0
#: The longest wait after a failed restart attempt.
RESTART_BACKOFF_MAX_S = 30.0
#: How many times a restart tries to start fresh workers before the engine is dead.
RESTART_ATTEMPTS = 3


class WorkerRestart:
    """Starts fresh workers for a core; see the module docstring."""

    def __init__(self, start_fresh: Callable[[], Executor] | None,
                 attempts: int = RESTART_ATTEMPTS):
        #: builds fresh (warm) workers; None: restarts are off
        self._start_fresh = start_fresh
        self._attempts = attempts
        #: fresh workers started since the engine started
        self.restarts = 0
        #: submissions made while fresh workers start wait here
        self.gate = RestartGate()

    @property
    def enabled(self) -> bool:
        return self._start_fresh is not None

    def run(self, old: Executor, *, fail_running: Callable[[], None],
            stopped: Callable[[], bool], swap: Callable[[Executor], bool],
            die: Callable[[str], None]) -> bool:
        """Replace ``old``: ``fail_running`` first, then start fresh workers
        and ``swap`` them in (False from it: the core stopped meanwhile, the
        fresh ones are shut down). True once fresh workers serve; False when
        the core stopped or every attempt failed (then ``die`` was called).
        The held submissions are woken at the end either way."""
        try:
            return self._replace(old, fail_running, stopped, swap, die)
        finally:
            self.gate.wake()

    def _replace(self, old: Executor, fail_running: Callable[[], None],
                 stopped: Callable[[], bool], swap: Callable[[Executor], bool],
                 die: Callable[[str], None]) -> bool:
        assert self._start_fresh is not None, "restarts are off"
        fail_running()
        old.shutdown()
        error = None
        for attempt in range(1, self._attempts + 1):
            if stopped():
                return False
            logger.warning("workers died; starting fresh ones (attempt %d of %d)", attempt,
                           self._attempts)
            try:
                new = self._start_fresh()
            except Exception as exc:
                error = exc
                logger.error("restart attempt %d failed: %s", attempt, exc)
                time.sleep(restart_backoff_s(attempt))
                continue
            if not swap(new):
                new.shutdown()
                return False
            self.restarts += 1
            logger.warning("fresh workers serving (restart %d)", self.restarts)
            return True
        die(f"executor died and {self._attempts} restarts failed: {error}")
        return False


def restart_backoff_s(attempt: int) -> float:
    """The wait after failed restart attempt ``attempt`` (1-based)."""
    return min(RESTART_BACKOFF_S * 2 ** (attempt - 1), RESTART_BACKOFF_MAX_S)


def restart_worst_case_s(start_s: float, stop_s: float,
                         attempts: int = RESTART_ATTEMPTS) -> float:
    """The longest a restart takes before fresh workers serve or it gives up:
    the loop noticing the dead workers, stopping them, then per attempt
    starting fresh ones (``start_s``: their start-up and warm-up limits),
    stopping them when the attempt failed, and the back-off."""
    per_attempt = [start_s + stop_s + restart_backoff_s(a) for a in range(1, attempts + 1)]
    return RESTART_CHECK_S + stop_s + sum(per_attempt)


__all__ = ["RESTART_ATTEMPTS", "WorkerRestart", "restart_backoff_s", "restart_worst_case_s"]
