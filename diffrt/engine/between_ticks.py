"""Work the engine loop runs between two ticks, on its own thread: weight
updates, sleep and wake (docs/rollouts.md).

A job that *drains* waits until no request is running or paused: meanwhile
the scheduler admits no new request (``Scheduler.holding``; paused ones may
resume and finish), so the running requests finish on the weights they
started with and the job then runs with the workers idle. The submitter
waits on the job's future. The core keeps the queue under its lock
(``EngineCore.between_ticks``); nothing here calls the executor under it.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from typing import Any

from diffrt.engine.sched import Scheduler
from diffrt.runtime.executor import Executor


class BetweenTicks:
    """One job: ``work(executor)`` on the loop's thread, its result (or
    exception) in ``future``."""

    def __init__(self, work: Callable[[Executor], Any], *, drain: bool, what: str):
        self.work = work
        self.drain = drain
        self.what = what
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def ready(self, scheduler: Scheduler) -> bool:
        """It may run now: it does not drain, or nothing runs any more."""
        return not self.drain or (scheduler.num_running == 0 and scheduler.num_paused == 0)

    def run(self, executor: Executor) -> None:
        try:
            self.future.set_result(self.work(executor))
        except BaseException as exc:  # the submitter gets it; the loop goes on
            self.future.set_exception(exc)


class JobQueue:
    """The jobs waiting for their boundary, in order (under the core's lock)."""

    def __init__(self) -> None:
        self._jobs: deque[BetweenTicks] = deque()
        #: the workers sleep (``DiffusionEngine.sleep``): nothing is admitted until they wake
        self.asleep = False

    def add(self, job: BetweenTicks, scheduler: Scheduler) -> None:
        self._jobs.append(job)
        self.hold(scheduler)

    def hold(self, scheduler: Scheduler) -> None:
        """No new admission while a draining job waits or the workers sleep."""
        scheduler.holding = self.asleep or any(job.drain for job in self._jobs)

    def next_ready(self, scheduler: Scheduler) -> BetweenTicks | None:
        """The first job, taken, when it may run now."""
        if self._jobs and self._jobs[0].ready(scheduler):
            return self._jobs.popleft()
        return None

    def fail_all(self, reason: str, scheduler: Scheduler) -> None:
        from diffrt.engine.errors import EngineClosedError

        while self._jobs:
            job = self._jobs.popleft()
            if not job.future.done():
                job.future.set_exception(EngineClosedError(f"{job.what}: {reason}"))
        self.hold(scheduler)

    def __bool__(self) -> bool:
        return bool(self._jobs)


__all__ = ["BetweenTicks", "JobQueue"]
