"""Submissions made while fresh workers start (``restart_workers``).

Their records are queued for the fresh workers and their submitter waits
(``RestartHolds.wait`` blocks the calling thread, ``wait_async`` lets the
event loop run) at the core's ``RestartGate``, at most ``restart_wait_s``
or the records' own timeout. The hold ends one of three ways: the records
stand (the fresh workers serve them, or an abort or a close ended them),
``EngineDeadError`` when the restart gave up, or ``EngineRestartingError``
when the workers were still starting at the bound — the records are then
taken back unreported, as if refused at submission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from diffrt.engine.config import EngineConfig
from diffrt.engine.core import EngineCore
from diffrt.engine.errors import EngineDeadError, EngineRestartingError
from diffrt.engine.output_processor import OutputProcessor
from diffrt.engine.record import RequestRecord
from diffrt.engine.restart import restart_worst_case_s

#: What stopping a set of workers may add to shutdown_grace_s (the pump's join,
#: then SIGTERM and SIGKILL in the multiprocess executor: 5 + 2 + 5 s), for
#: the worst case of a restart (``restart_wait_s=None``).
WORKER_STOP_SLACK_S = 12.0


@dataclass
class Hold:
    """A submission made while fresh workers start: its records are queued
    for them, and its submitter waits until ``until`` (the engine's clock)."""

    records: list[RequestRecord]
    since: float
    until: float
    #: what set ``until``, for the error past it
    bound: str

    def release(self) -> None:
        """The wait is over: the core's timer may end the records again."""
        for record in self.records:
            record.held = False


class RestartHolds:
    """The holds of one engine; see the module docstring."""

    def __init__(self, config: EngineConfig, core: EngineCore, outputs: OutputProcessor,
                 clock: Callable[[], float]):
        self._core = core
        self._outputs = outputs
        self._clock = clock
        #: how long a submission during a restart waits for it, and why that long
        self._wait_s, self._bound = restart_wait(config)

    def hold_for(self, records: list[RequestRecord], now: float) -> Hold:
        """How long records submitted at ``now`` wait for fresh workers: the
        restart wait, or the first of their own timeouts when that comes sooner."""
        until, bound = now + self._wait_s, self._bound
        for record in records:
            if record.timeout_at is not None and record.timeout_at < until:
                until, bound = record.timeout_at, "its timeout"
        return Hold(records, now, until, bound)

    def _held(self, hold: Hold) -> bool:
        """Fresh workers are still starting and some of the records still waits."""
        return self._core.is_restarting() and self._core.any_waiting(hold.records)

    def wait(self, hold: Hold, give_up_at: float | None, timeout: float | None) -> None:
        """``generate``'s wait for fresh workers (the calling thread blocks):
        raises as ``_end`` does, or TimeoutError when the call's own
        ``timeout`` (``give_up_at``, monotonic) comes first."""
        try:
            until = hold.until
            if give_up_at is not None:
                until = min(until, self._clock() + give_up_at - time.monotonic())
            done = self._core.restart_gate.wait(lambda: self._held(hold), until, self._clock)
            if not done and until < hold.until:
                raise TimeoutError(f"{len(hold.records)} request(s) did not finish within "
                                   f"{timeout} s (fresh workers were still starting)")
            self._end(hold, done)
        finally:
            hold.release()

    async def wait_async(self, hold: Hold) -> None:
        """``step_streaming``'s wait for fresh workers: the event loop runs on."""
        try:
            done = await self._core.restart_gate.wait_async(lambda: self._held(hold),
                                                            hold.until, self._clock)
            self._end(hold, done)
        finally:
            hold.release()

    def _end(self, hold: Hold, done: bool) -> None:
        """The outcome of a hold (``done``: it ended before ``hold.until``)."""
        if self._core.dead_reason is not None:
            self._outputs.discard(hold.records)  # ended already: streams closed
            raise EngineDeadError(f"engine is not healthy: {self._core.dead_reason}")
        if done or not self._core.withdraw(hold.records):  # else admitted meanwhile: served
            return
        self._outputs.discard(hold.records)
        raise EngineRestartingError(
            f"the engine is restarting: fresh workers were not serving within "
            f"{hold.until - hold.since:g} s ({hold.bound}); retry shortly")


def restart_wait(config: EngineConfig) -> tuple[float, str]:
    """``restart_wait_s``, or the restart's worst case when it is None; and
    how the error past it names it."""
    ex = config.executor
    if ex.restart_wait_s is not None:
        return ex.restart_wait_s, f"restart_wait_s={ex.restart_wait_s:g}"
    worst = restart_worst_case_s(
        start_s=ex.startup_timeout_s + config.model_config.warmup_timeout_s,
        stop_s=ex.shutdown_grace_s + WORKER_STOP_SLACK_S)
    return worst, f"the longest a restart takes, {worst:g} s"


__all__ = ["WORKER_STOP_SLACK_S", "Hold", "RestartHolds", "restart_wait"]
