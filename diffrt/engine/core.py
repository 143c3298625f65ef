"""EngineCore: the scheduler, the executor, the tick loop and the timer.

One thread (``diffrt-engine-loop``) repeats three steps, as vLLM's
``EngineCore.step()`` does:

* schedule: wait for work, ask the scheduler for a tick (``_schedule``);
* execute: send it to the workers as one typed request (``ExecuteBatch`` or
  ``ExecuteStep``), wait for COMPUTE_DONE and their ``TickReport`` (``_execute``);
* update: apply the report to the scheduler and report what happened as a
  ``TickResult`` (progress, terminal events, the outputs now on their way to
  host memory as ``OutputRef``s) to ``on_tick`` (``_update``).

The core owns no streams and never waits for an output: whoever receives the
``TickResult`` (the engine's ``OutputProcessor``) delivers it. The tick's
pieces outside the loop live in their rooms: the request and the report's
reading in ``tick.py``, fresh workers after a death in ``restart.py``, the
server's seats among the waiting in ``seats.py``, the adapters a tick
carries in ``lora/tick_adapters.py``, the deadline refusal in the
scheduler (``Scheduler.refuse_if_late``).

Data flows one way, from the core to ``on_tick``: an abort is one call here
(``abort``), whose outcome travels back as a ``TickResult`` like any tick's;
the timer thread (``diffrt-engine-timer``) ends requests past their timeout
the same way and asks the output processor to free outputs left unread.

Locking: the core's Condition guards the scheduler and the seat count. It is
never held while the executor is called or a callback runs, and never
together with the output processor's lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable

from diffrt import tracing
from diffrt.engine.between_ticks import BetweenTicks, JobQueue
from diffrt.engine.config import ExecutionMode
from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.lora.tick_adapters import TickAdapters
from diffrt.engine.memory_estimate import MemoryModel
from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.restart import (
    RESTART_ATTEMPTS,
    RESTART_CHECK_S,
    WorkerRestart,
    restart_backoff_s,
    restart_worst_case_s,
)
from diffrt.engine.restart_gate import RestartGate
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.sched import AbortOutcome, Scheduler, SchedulerOutput, UpdateResult
from diffrt.engine.seats import Seat, Seats
from diffrt.engine.tick import (
    AbortNotice,
    Executed,
    TickResult,
    execution_result,
    ran_requests,
    read_report,
    route_outputs,
    seconds_per_step,
    tick_request,
)
from diffrt.runtime.executor import Executor
from diffrt.runtime.types import ExecutorDeadError

logger = logging.getLogger(__name__)

#: How long the loop sleeps when the scheduler has work but returned no tick.
IDLE_RETRY_S = 0.05
#: ``_schedule``'s answer when the workers died and fresh ones are to be started.
_RESTART = object()
#: How often the timer looks for requests past their timeout and unread outputs.
TIMER_PERIOD_S = 0.1


class EngineCore:
    """Runs ticks on its own thread; see the module docstring."""

    def __init__(self, mode: ExecutionMode, scheduler: Scheduler, executor: Executor, *,
                 on_tick: Callable[[TickResult], None], on_dead: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic,
                 restart: Callable[[], Executor] | None = None,
                 on_timer: Callable[[float], None] | None = None,
                 restart_attempts: int = RESTART_ATTEMPTS,
                 run_time: RunTimeModel | None = None,
                 memory: MemoryModel | None = None,
                 adapters: AdapterRegistry | None = None,
                 refuse_unmeetable: bool = False):
        self.mode = mode
        #: refuse a request the scheduler says would miss its deadline (``lateness``)
        self.refuse_unmeetable = refuse_unmeetable
        #: LoRA adapters: pinned by the requests queued here, their device
        #: slots sent with each tick (a registry of None: the model takes none)
        self.loras = TickAdapters(adapters)
        self.scheduler = scheduler
        self.executor = executor
        self._memory = memory
        self._on_tick = on_tick
        self._on_dead = on_dead
        self._clock = clock
        self._cond = threading.Condition()
        self._stopped = False
        self.dead_reason: str | None = None
        #: builds fresh (warm) workers after the old ones died (``restart`` None: off)
        self._restart = WorkerRestart(restart, restart_attempts)
        #: called by the timer with ``now`` (the output processor frees unread outputs)
        self._on_timer = on_timer
        #: learns each tick's seconds per step (the estimate max_request_seconds reads)
        self._run_time = run_time
        #: (timeout_at, n, record) of every record given a timeout; weak, so a
        #: finished request's record (prompt, output) is not kept until then
        self._timeouts: list[tuple[float, int, weakref.ref[RequestRecord]]] = []
        self._timeout_seq = itertools.count()
        self._timer_stop = threading.Event()
        #: seats taken whose request has not reached the scheduler (``seats.py``)
        self.seats = Seats(self._cond)
        #: work between ticks (``between_ticks.py``), and the weights' version
        #: the requests admitted now run on (a weight update's job sets it)
        self.jobs = JobQueue()
        self.weights_version: int | str = 0
        self._thread = threading.Thread(target=self._loop, name="diffrt-engine-loop", daemon=True)
        self._timer = threading.Thread(target=self._watch, name="diffrt-engine-timer",
                                       daemon=True)

    @property
    def restart_gate(self) -> RestartGate:
        """Where submissions made while fresh workers start wait (``restart_gate.py``)."""
        return self._restart.gate

    @property
    def restarts(self) -> int:
        return self._restart.restarts

    def start(self) -> None:
        self._thread.start()
        self._timer.start()

    # -- called by the engine's threads ---------------------------------------------
    def add(self, records: list[RequestRecord]) -> bool:
        """Queue ``records`` (all or none); False once the core has stopped.

        Raises InvalidRequestError when an id is still in the scheduler: a
        request ended early (a timeout during its forward) keeps its id there
        until its tick completes. A record aborted before it got here (an
        abort racing its submission) is not queued: it has ended already.
        """
        with self._cond:
            if self._stopped or self.dead_reason is not None:
                return False
            for record in records:
                if self.scheduler.has_request(record.request_id):
                    raise InvalidRequestError(
                        "request_id", f"{record.request_id!r} is still finishing; "
                        "use another id or retry in a moment")
                if self.refuse_unmeetable:
                    self.scheduler.refuse_if_late(record, self._clock())
            self.loras.pin_all([r for r in records if not r.aborted])
            for record in records:
                if not record.aborted:
                    self.scheduler.add(record)
                self.seats.queue(record)
                if record.timeout_at is not None:
                    heapq.heappush(self._timeouts, (record.timeout_at, next(self._timeout_seq),
                                                    weakref.ref(record)))
            self._cond.notify_all()
        return True

    def abort(self, request_id: str, reason: str | None = None,
              record: RequestRecord | None = None) -> None:
        """Stop a request at the next step boundary (``reason`` None: the
        user's abort; else the error of the limit that ends it); with
        ``record``, only that record, not a newer request reusing its id. The
        outcome goes to ``on_tick`` as a ``TickResult`` with one ``AbortNotice``.

        The record is marked here, under the core's lock, before the
        scheduler decides: a tick that ends it meanwhile reports it with this
        reason, and a record not yet queued (an abort racing its submission)
        is never queued."""
        with self._cond:
            current = self.scheduler.record(request_id)
            target = record if record is not None else current
            if target is not None and not target.aborted:
                target.aborted, target.abort_reason = True, reason
            if record is not None and current is not record:
                outcome, event = AbortOutcome.UNKNOWN, None  # not (or no longer) scheduled
            else:
                outcome, event = self.scheduler.abort(request_id)
            self._cond.notify_all()  # STEP_BATCH: the loop sends the drop
        self._on_tick(TickResult(scheduled_ids=[], started_at=self._clock(), elapsed=0.0,
                                 aborts=[AbortNotice(request_id, reason, outcome, event,
                                                     record)]))
        self.loras.drop_unused(self.executor)  # it may have held a removed adapter's last claim

    def between_ticks(self, job: BetweenTicks) -> None:
        """Queue ``job`` for the loop's thread between two ticks (``between_ticks.py``)."""
        with self._cond:
            self.jobs.add(job, self.scheduler)
            if self._stopped or self.dead_reason is not None:
                self.jobs.fail_all(self.dead_reason or "engine closed", self.scheduler)
            self._cond.notify_all()

    def running(self, request_ids: list[str]) -> list[str]:
        """Those of ``request_ids`` running or paused now (a weight update's abort policy)."""
        with self._cond:
            return [rid for rid in request_ids if (r := self.scheduler.record(rid)) is not None
                    and r.status in (RequestStatus.RUNNING, RequestStatus.PAUSED)]

    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running) requests: waiting counts the scheduler's queue and
        the seats whose request has not reached it yet."""
        with self._cond:
            return self.seats.held + self.scheduler.num_waiting, self.scheduler.num_running

    def take_seat(self, limit: int, on_admitted: Callable[[], None] | None = None) -> Seat:
        """A seat among the waiting, or a refused one when ``limit`` wait
        (``seats.py``); a refused seat carries the predicted seconds until
        the next admission frees one (``Seat.retry_after_s``)."""
        seat = self.seats.take(limit, lambda: self.scheduler.num_waiting, on_admitted)
        if not seat.taken:
            model = self._run_time
            with self._cond:
                seat.retry_after_s = self.scheduler.next_admission_s(
                    self._clock(), model.loaded_step_seconds if model else lambda _: None)
        return seat

    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    def is_restarting(self) -> bool:
        """Fresh workers are being started, or are about to be (the executor
        is down and the loop has yet to notice): restarts are on and the core
        neither stopped nor gave up. New records are queued for them."""
        return (self._restart.enabled and self.dead_reason is None and not self._stopped
                and self._thread.is_alive() and not self.executor.is_healthy())

    def paused(self) -> tuple[int, int, int]:
        """(requests paused now, the step state bytes they keep, preemptions since start)."""
        with self._cond:
            s = self.scheduler
            return s.num_paused, s.paused_state_bytes(), s.preemptions

    def any_waiting(self, records: list[RequestRecord]) -> bool:
        """Some of ``records`` is still queued, not yet admitted to a batch."""
        with self._cond:
            return any(self.scheduler.record(r.request_id) is r
                       and r.status is RequestStatus.WAITING for r in records)

    def withdraw(self, records: list[RequestRecord]) -> bool:
        """Take queued ``records`` back, reporting nothing: a submission that
        waited for a restart in vain is refused as if never queued. All or
        none: False, and nothing changed, once one of them was admitted (the
        fresh workers serve it, so its submission stands)."""
        with self._cond:
            queued = [r for r in records if self.scheduler.record(r.request_id) is r]
            if any(r.status is not RequestStatus.WAITING for r in queued):
                return False
            for record in queued:
                self.scheduler.abort(record.request_id)  # a waiting one: removed at once
            self._cond.notify_all()
        self.loras.drop_unused(self.executor)
        return True

    def stop(self, grace_s: float) -> None:
        """Stop taking ticks, let the one in flight finish for up to ``grace_s``,
        then shut the executor down (which fails a tick still waiting)."""
        with self._cond:
            self._stopped = True
            self.scheduler.fail_all("engine closed")
            self.jobs.fail_all("engine closed", self.scheduler)
            self._cond.notify_all()
        self.restart_gate.wake()
        self._timer_stop.set()
        if self._timer.is_alive() and self._timer is not threading.current_thread():
            self._timer.join(grace_s)
        if self._thread.is_alive():
            self._thread.join(grace_s)
            if self._thread.is_alive():
                logger.warning("engine loop still busy after %.1f s; shutting the executor down",
                               grace_s)
        self.executor.shutdown()
        if self._thread.is_alive():
            self._thread.join(grace_s)

    # -- the loop: schedule -> execute -> update ------------------------------------------
    def _loop(self) -> None:
        tracing.process_name(tracing.ENGINE_PROCESS)
        try:
            while (tick := self._schedule()) is not None:
                if isinstance(tick, BetweenTicks):
                    tick.run(self.executor)
                    with self._cond:
                        self.jobs.hold(self.scheduler)
                    continue
                if not isinstance(tick, SchedulerOutput):  # _RESTART
                    if not self._restart_workers():
                        return
                    continue
                self.seats.tell_admitted()
                ran = self._execute(tick)
                if ran is None:  # the executor died, and no restart replaces it
                    return
                self._on_tick(self._update(tick, ran))
                self.loras.drop_unused(self.executor)
        except Exception as exc:  # a bug in the engine: fail everything, visibly
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {exc!r}")

    def _schedule(self) -> SchedulerOutput | object | None:
        """Block until there is work (or the core stops) and schedule a tick;
        None means stop, ``_RESTART`` that the workers died and fresh ones are
        to be started."""
        with self._cond:
            while True:
                if self._stopped or self.dead_reason is not None:
                    return None
                if self._restart.enabled and not self.executor.is_healthy():
                    return _RESTART
                if (job := self.jobs.next_ready(self.scheduler)) is not None:
                    return job
                if not self.scheduler.has_work():
                    # with restarts on, look at the workers' health now and then
                    self._cond.wait(RESTART_CHECK_S if self._restart.enabled else None)
                    continue
                now = self._clock()
                wait = self.scheduler.admission_wait_s(now)
                if wait <= 0:
                    tick = self.scheduler.schedule(now)
                    if tick is not None:
                        admitted = [self.scheduler.record(r.request_id) for r in tick.new]
                        for record in filter(None, admitted):
                            record.weights_version = self.weights_version
                        self.seats.note_admitted(admitted)
                        self.loras.attach(tick, self.scheduler.record)
                        return tick
                    wait = IDLE_RETRY_S
                self._cond.wait(wait)

    def _execute(self, tick: SchedulerOutput) -> Executed | None:
        """Run ``tick`` on the workers. None when the executor died and no
        restart replaces it (the core is dead then)."""
        start = self._clock()
        request = tick_request(self.mode, tick, report_state_bytes=self.scheduler.preempting)
        ran = Executed(start, 0.0, self.executor)  # the outputs of this tick are its executor's
        try:
            with tracing.span(tracing.ENGINE_LOOP_TRACK, str(request.__struct_config__.tag),
                              keys=tick.scheduled_ids, drop=tick.drop_ids):
                out = ran.executor.execute(request)
            ran.output_ids = dict(out.output_ids)
            ran.report = read_report(out.reply)
            self.loras.after_reply(ran.report)
        except ExecutorDeadError as exc:
            self.loras.tick_failed(tick)
            if not self._restart.enabled:
                self._die(f"executor died: {exc}")
                return None
            # this tick's requests (and any other running one) fail in
            # _restart_workers, which the loop runs next
            logger.error("executor died: %s", exc)
            ran.dead = True
        except Exception as exc:  # the runner raised: this tick's requests fail
            self.loras.tick_failed(tick)
            logger.error("%s failed: %s", type(request).__name__, exc)
            ran.failed_all = f"{type(exc).__name__}: {exc}"
        ran.elapsed = self._clock() - start
        return ran

    def _update(self, tick: SchedulerOutput, ran: Executed) -> TickResult:
        """Apply the tick's report to the scheduler (and to what learns from
        it: the run-time and memory estimates), then route its outputs."""
        if ran.dead:
            return TickResult(scheduled_ids=[], started_at=ran.started_at, elapsed=ran.elapsed)
        report = ran.report
        step_seconds = None if ran.failed_all else seconds_per_step(self.mode, tick, ran)
        with self._cond:
            rows, tokens = self._observe(tick, ran, step_seconds)
            update = self.scheduler.update_from_output(tick, execution_result(tick, ran))
            self._observe_finished(update)
        outputs, previews = route_outputs(update, ran)
        return TickResult(scheduled_ids=list(tick.scheduled_ids), started_at=ran.started_at,
                          elapsed=ran.elapsed, progress=update.progress,
                          finished=update.finished, outputs=outputs, previews=previews,
                          step_seconds=step_seconds,
                          steps=ran.steps_run if self.mode is ExecutionMode.STEP_BATCH else 1,
                          text_encoding=report.text_encoding,
                          prompt_tokens_dropped=dict(report.prompt_tokens_dropped),
                          cache=dict(report.cache), step_rows=rows, step_tokens=tokens,
                          predicted_s=ran.predicted_s)

    def _observe(self, tick: SchedulerOutput, ran: Executed,
                 step_seconds: float | None) -> tuple[int, int]:
        """Under the lock, before the scheduler lets finished requests go: the
        run-time and memory estimates learn from the tick; its (rows, tokens)."""
        requests = ran_requests(self.mode, tick, self.scheduler)
        if self._run_time is not None and step_seconds is not None:
            ran.predicted_s = self._run_time.observe_tick(
                requests, ran.steps_run if self.mode is ExecutionMode.STEP_BATCH
                else requests[0].sampling_params.denoise_steps(), ran.elapsed,
                new=len(tick.new), decoded_tokens=sum(
                    self._run_time.decoded_tokens(r) for r in requests
                    if r.request_id in ran.output_ids))
            tracing.instant(tracing.ENGINE_LOOP_TRACK, "step cost", measured_s=ran.elapsed,
                            predicted_s=ran.predicted_s, steps=ran.steps_run,
                            requests=len(requests))
        report = ran.report
        if self._memory is not None and (report.peak_memory_bytes is not None
                                         or report.free_memory_bytes is not None):
            self._memory.observe(requests, report.peak_memory_bytes, report.free_memory_bytes)
        return self.scheduler.step_tokens(requests) if step_seconds is not None else (0, 0)

    def _observe_finished(self, update: UpdateResult) -> None:
        """Under the lock: the automatic batching window learns from the
        requests that finished."""
        done_at = self._clock()
        for event in update.finished:
            if event.status is RequestStatus.FINISHED and event.admitted_at is not None:
                self.scheduler.observe_run_time(done_at - event.admitted_at)

    # -- fresh workers ------------------------------------------------------------------
    def _restart_workers(self) -> bool:
        """Fail the requests that were running (their state died with the
        workers), start fresh workers and serve the waiting requests with
        them (``restart.py``); False when it gave up or the core stopped."""
        def fail_running() -> None:
            with self._cond:
                events = self.scheduler.fail_running(
                    "workers died; the request was running on them")
            if events:
                self._on_tick(TickResult(scheduled_ids=[], started_at=self._clock(),
                                         elapsed=0.0, finished=events))

        def swap(new: Executor) -> bool:
            with self._cond:
                if self._stopped:
                    return False
                self.executor = new
                self.loras.workers_replaced()
                self.weights_version = 0  # fresh workers load the folder's weights
                return True

        return self._restart.run(self.executor, fail_running=fail_running,
                                 stopped=lambda: self._stopped, swap=swap, die=self._die)

    # -- the timer ----------------------------------------------------------------------
    def _watch(self) -> None:
        """Every ``TIMER_PERIOD_S``: end the requests past their timeout (as
        aborts with the limit's error; a forward in flight cannot be
        interrupted, but its request is answered now) and let ``on_timer`` free
        outputs left unread. A failed pass is logged and retried."""
        while not self._timer_stop.wait(TIMER_PERIOD_S):
            try:
                now = self._clock()
                for record in self._due(now):
                    logger.info("%s: %s", record.request_id, record.timeout_reason)
                    self.abort(record.request_id, record.timeout_reason or "request timed out",
                               record)
                if self._on_timer is not None:
                    self._on_timer(now)
            except Exception:
                logger.exception("engine timer pass failed")

    def _due(self, now: float) -> list[RequestRecord]:
        """Records whose timeout has come and that have not ended yet. One
        whose submitter still waits for a restart is that wait's to end (the
        restarting error, not a timeout): it is looked at again next pass."""
        due = []
        with self._cond:
            while self._timeouts and self._timeouts[0][0] <= now:
                entry = heapq.heappop(self._timeouts)
                record = entry[2]()
                if (record is None or record.metrics.finished_time is not None
                        or record.aborted):
                    continue
                if record.held:
                    heapq.heappush(self._timeouts, (now + TIMER_PERIOD_S, *entry[1:]))
                    continue
                due.append(record)
        return due

    def _die(self, reason: str) -> None:
        logger.error("engine is unhealthy: %s", reason)
        with self._cond:
            if self.dead_reason is None and not self._stopped:
                self.dead_reason = reason
            self.scheduler.fail_all(reason)
            self.jobs.fail_all(reason, self.scheduler)
            self._cond.notify_all()
        self._on_dead(reason)
        self.restart_gate.wake()


__all__ = ["AbortNotice", "EngineCore", "TickResult", "restart_backoff_s",
           "restart_worst_case_s"]
