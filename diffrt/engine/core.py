"""EngineCore: the scheduler, the executor, the tick loop and the timer.

One thread (``diffrt-engine-loop``) repeats: wait for work, ask the scheduler
for a tick, send it to the workers as one typed request (``ExecuteBatch`` or
``ExecuteStep``), wait for COMPUTE_DONE, apply the reply to the scheduler, and
report what happened as a ``TickResult`` (progress, terminal events, the
outputs now on their way to host memory as ``OutputRef``s). The core owns no
streams and never waits for an output: whoever receives the ``TickResult``
(the engine's ``OutputProcessor``) delivers it.

Data flows one way, from the core to ``on_tick``: an abort is one call here
(``abort``), whose outcome travels back as a ``TickResult`` like any tick's;
the timer thread (``diffrt-engine-timer``) ends requests past their timeout
the same way and asks the output processor to free outputs left unread.

The core also keeps a server's seats among the waiting (``seats.py``): a
seat is taken, moved into the queue with its record, and told of its
admission under the same lock as the scheduler, so a server's bound on the
waiting requests has no race.

Locking: the core's Condition guards the scheduler and the seat count. It is
never held while the executor is called or a callback runs, and never
together with the output processor's lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffrt import tracing
from diffrt.engine.config import EngineMode
from diffrt.engine.errors import DeadlineUnmeetableError
from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.memory_estimate import MemoryModel
from diffrt.engine.output_ref import OutputRef
from diffrt.engine.outputs import CacheMetrics, TextEncoderStats
from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.restart_gate import RestartGate
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.runner_messages import (
    BatchDone,
    DropLora,
    ExecuteBatch,
    ExecuteStep,
    StepDone,
)
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    Finished,
    Progress,
    Scheduler,
    SchedulerOutput,
)
from diffrt.engine.seats import Seat, SeatState
from diffrt.runtime.executor import Executor
from diffrt.runtime.types import ExecutorDeadError

logger = logging.getLogger(__name__)

#: How long the loop sleeps when the scheduler has work but returned no tick.
IDLE_RETRY_S = 0.05
#: With restarts on, how often an idle loop looks at the workers' health.
RESTART_CHECK_S = 0.5
#: The first wait after a failed restart attempt (doubling each time).
RESTART_BACKOFF_S = 1.0
#: The longest wait after a failed restart attempt.
RESTART_BACKOFF_MAX_S = 30.0
#: How many times a restart tries to start fresh workers before the engine is dead.
RESTART_ATTEMPTS = 3
#: ``_next_tick``'s answer when the workers died and fresh ones are to be started.
_RESTART = object()
#: How often the timer looks for requests past their timeout and unread outputs.
TIMER_PERIOD_S = 0.1


@dataclass
class AbortNotice:
    """The outcome of one ``EngineCore.abort``, for the output processor."""

    request_id: str
    #: None: the user aborted it; else the limit that ended it (its error)
    reason: str | None
    outcome: AbortOutcome
    #: the terminal event when the scheduler ended it at once (``DONE``)
    event: Finished | None = None
    #: the record meant (None: whichever is active under that id)
    record: RequestRecord | None = None


@dataclass
class TickResult:
    """What one execute call did, in engine terms."""

    #: ids run or advanced in this tick, in batch order.
    scheduled_ids: list[str]
    started_at: float
    elapsed: float
    progress: list[Progress] = field(default_factory=list)
    #: requests that left the scheduler in this tick.
    finished: list[Finished] = field(default_factory=list)
    #: request id -> its output, for the FINISHED events that produced one.
    outputs: dict[str, OutputRef] = field(default_factory=dict)
    #: request id -> (output, preview index), for previews of requests still
    #: running (``partial_images``).
    previews: dict[str, tuple[OutputRef, int]] = field(default_factory=dict)
    #: aborts decided since the last report (``EngineCore.abort``, the timer)
    aborts: list[AbortNotice] = field(default_factory=list)
    #: seconds per denoise step of this tick's batch (None: nothing ran).
    step_seconds: float | None = None
    #: how many denoise steps ``step_seconds`` stands for (a multi-step tick)
    steps: int = 1
    #: the text encoding the workers did in this tick.
    text_encoding: TextEncoderStats | None = None
    #: STEP_BATCH: the tick's rows and the tokens a step of it computed
    #: (``StepScheduler.step_tokens``); 0 when not counted
    step_rows: int = 0
    step_tokens: int = 0
    #: request id -> text encoder -> prompt tokens it cut (``BatchDone``)
    prompt_tokens_dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    #: request id -> what its step cache did, for requests that finished with one
    cache: dict[str, CacheMetrics] = field(default_factory=dict)


class EngineCore:
    """Runs ticks on its own thread; see the module docstring."""

    def __init__(self, mode: EngineMode, scheduler: Scheduler, executor: Executor, *,
                 on_tick: Callable[[TickResult], None], on_dead: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic,
                 restart: Callable[[], Executor] | None = None,
                 on_timer: Callable[[float], None] | None = None,
                 restart_attempts: int = RESTART_ATTEMPTS,
                 run_time: RunTimeModel | None = None,
                 memory: MemoryModel | None = None,
                 adapters: AdapterRegistry | None = None,
                 reject_unmeetable: bool = False):
        self.mode = mode
        #: refuse a request the scheduler says would miss its deadline (``lateness``)
        self.reject_unmeetable = reject_unmeetable
        #: LoRA adapters: pinned by the requests queued here, their device
        #: slots sent with each tick (None: the model takes none)
        self.adapters = adapters
        self.scheduler = scheduler
        self.executor = executor
        self._memory = memory
        self._on_tick = on_tick
        self._on_dead = on_dead
        self._clock = clock
        self._cond = threading.Condition()
        self._stopped = False
        self.dead_reason: str | None = None
        #: builds fresh (warm) workers after the old ones died; None: no restart
        self._restart = restart
        self._restart_attempts = restart_attempts
        self.restarts = 0
        #: submissions made while fresh workers start wait here (``restart_gate.py``)
        self.restart_gate = RestartGate()
        #: called by the timer with ``now`` (the output processor frees unread outputs)
        self._on_timer = on_timer
        #: learns each tick's seconds per step (the estimate max_request_seconds reads)
        self._run_time = run_time
        #: (timeout_at, n, record) of every record given a timeout; weak, so a
        #: finished request's record (prompt, output) is not kept until then
        self._timeouts: list[tuple[float, int, weakref.ref[RequestRecord]]] = []
        self._timeout_seq = itertools.count()
        self._timer_stop = threading.Event()
        #: seats taken whose request has not reached the scheduler (under _cond)
        self._held_seats = 0
        #: seats of the requests the last schedule admitted (the loop's thread only)
        self._admitted_seats: list[Seat] = []
        self._thread = threading.Thread(target=self._loop, name="diffrt-engine-loop", daemon=True)
        self._timer = threading.Thread(target=self._watch, name="diffrt-engine-timer",
                                       daemon=True)

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
                if self.reject_unmeetable:
                    self._refuse_if_late(record)
            self._pin_adapters([r for r in records if not r.aborted])
            for record in records:
                if not record.aborted:
                    self.scheduler.add(record)
                self._queue_seat(record)
                if record.timeout_at is not None:
                    heapq.heappush(self._timeouts, (record.timeout_at, next(self._timeout_seq),
                                                    weakref.ref(record)))
            self._cond.notify_all()
        return True

    def _refuse_if_late(self, record: RequestRecord) -> None:
        """Under the lock: DeadlineUnmeetableError when the queue ahead and
        its own work would take ``record`` past its deadline."""
        late = self.scheduler.lateness(record, self._clock())
        if late is None or late <= 0:
            return
        deadline = record.request.sampling_params.deadline_s
        retry = max(1.0, math.ceil(late))
        raise DeadlineUnmeetableError(
            f"deadline_s: with the work queued ahead it would finish about {late:.2g} s after "
            f"its deadline of {deadline:g} s (reject_unmeetable); retry in {retry:.0f} s",
            retry_after_s=retry)

    def _pin_adapters(self, records: list[RequestRecord]) -> None:
        """Under the lock: resolve and hold the records' adapters (all or none:
        one removed since its submission was checked refuses the lot)."""
        if self.adapters is None:
            return
        pinned = []
        try:
            for record in records:
                self.adapters.pin(record)
                pinned.append(record)
        except InvalidRequestError:
            for record in pinned:
                self.adapters.release(record)
            raise

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
        self.drop_adapters()  # it may have held the last claim on a removed adapter

    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running) requests: waiting counts the scheduler's queue and
        the seats whose request has not reached it yet."""
        with self._cond:
            return self._held_seats + self.scheduler.num_waiting, self.scheduler.num_running

    # -- seats among the waiting (seats.py) ----------------------------------------------
    def take_seat(self, limit: int, on_admitted: Callable[[], None] | None = None) -> Seat:
        """A seat, or a refused one when ``limit`` requests wait already
        (the seats not yet queued plus the queue)."""
        with self._cond:
            waiting = self._held_seats + self.scheduler.num_waiting
            if waiting >= limit:
                return Seat(waiting)
            self._held_seats += 1
            return Seat(waiting, self._give_back, on_admitted)

    def _give_back(self, seat: Seat) -> None:
        with self._cond:
            if seat.state is SeatState.HELD:
                self._held_seats -= 1
                seat.state = SeatState.RELEASED

    def _queue_seat(self, record: RequestRecord) -> None:
        """Under the lock: ``record`` reached the scheduler (or ended first,
        an abort racing its submission); the queue counts it from now on."""
        seat = record.seat
        if seat is not None and seat.state is SeatState.HELD:
            self._held_seats -= 1
            seat.state = SeatState.QUEUED if not record.aborted else SeatState.RELEASED

    def _note_admitted(self, tick: SchedulerOutput) -> None:
        """Under the lock: the seats of the requests ``tick`` admits, told by
        the loop once the lock is released."""
        for request in tick.new:
            record = self.scheduler.record(request.request_id)
            seat = record.seat if record is not None else None
            if seat is not None and seat.state is SeatState.QUEUED:
                seat.state = SeatState.ADMITTED
                self._admitted_seats.append(seat)

    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    def is_restarting(self) -> bool:
        """Fresh workers are being started, or are about to be (the executor
        is down and the loop has yet to notice): restarts are on and the core
        neither stopped nor gave up. New records are queued for them."""
        return (self._restart is not None and self.dead_reason is None and not self._stopped
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
        self.drop_adapters()
        return True

    def stop(self, grace_s: float) -> None:
        """Stop taking ticks, let the one in flight finish for up to ``grace_s``,
        then shut the executor down (which fails a tick still waiting)."""
        with self._cond:
            self._stopped = True
            self.scheduler.fail_all("engine closed")
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

    # -- the loop --------------------------------------------------------------------
    def _loop(self) -> None:
        tracing.process_name(tracing.ENGINE_PROCESS)
        try:
            while (tick := self._next_tick()) is not None:
                if not isinstance(tick, SchedulerOutput):  # _RESTART
                    if not self._restart_workers():
                        return
                    continue
                admitted, self._admitted_seats = self._admitted_seats, []
                for seat in admitted:
                    seat.admitted()
                result = self._run_tick(tick)
                if result is None:
                    return
                self._on_tick(result)
                self.drop_adapters()
        except Exception as exc:  # a bug in the engine: fail everything, visibly
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {exc!r}")

    def _next_tick(self) -> SchedulerOutput | object | None:
        """Block until there is work (or the core stops); None means stop,
        ``_RESTART`` that the workers died and fresh ones are to be started."""
        with self._cond:
            while True:
                if self._stopped or self.dead_reason is not None:
                    return None
                if self._restart is not None and not self.executor.is_healthy():
                    return _RESTART
                if not self.scheduler.has_work():
                    # with restarts on, look at the workers' health now and then
                    self._cond.wait(None if self._restart is None else RESTART_CHECK_S)
                    continue
                now = self._clock()
                wait = self.scheduler.admission_wait_s(now)
                if wait <= 0:
                    tick = self.scheduler.schedule(now)
                    if tick is not None:
                        self._note_admitted(tick)
                        self._attach_loras(tick)
                        return tick
                    wait = IDLE_RETRY_S
                self._cond.wait(wait)

    def _attach_loras(self, tick: SchedulerOutput) -> None:
        """Under the lock: the slot assignments made since the last tick, and
        the adapters of the requests ``tick`` admits."""
        if self.adapters is None:
            return
        tick.lora_installs = self.adapters.take_installs()
        for request in tick.new:
            record = self.scheduler.record(request.request_id)
            if record is not None and record.lora_slots:
                tick.lora_rows[request.request_id] = [
                    (slot, adapter_id, scale) for (slot, scale), (adapter_id, _)
                    in zip(record.lora_slots, record.adapters, strict=True)]

    def _installs_unknown(self, tick: SchedulerOutput) -> None:
        """A tick that raised may not have filled its LoRA slots: assign them anew."""
        if self.adapters is not None and tick.lora_installs:
            self.adapters.slots_empty(list(tick.lora_installs))

    def drop_adapters(self) -> None:
        """Have the workers forget the removed adapters no request holds any more."""
        if self.adapters is None:
            return
        ids = self.adapters.take_drops()
        if not ids:
            return
        try:
            self.executor.collective_rpc(DropLora(ids))
        except Exception as exc:  # workers gone: nothing of theirs to free
            logger.warning("dropping LoRA adapters %s failed: %s", ids, exc)

    def _restart_workers(self) -> bool:
        """Fail the requests that were running (their state died with the
        workers), start fresh workers (bounded attempts, with back-off) and
        serve the waiting requests with them; False when it gave up. Either
        way the submissions held meanwhile are woken at the end."""
        try:
            return self._replace_executor()
        finally:
            self.restart_gate.wake()

    def _replace_executor(self) -> bool:
        old = self.executor
        with self._cond:
            events = self.scheduler.fail_running("workers died; the request was running on them")
        if events:
            self._on_tick(TickResult(scheduled_ids=[], started_at=self._clock(), elapsed=0.0,
                                     finished=events))
        old.shutdown()
        error = None
        for attempt in range(1, self._restart_attempts + 1):
            if self._stopped:
                return False
            logger.warning("workers died; starting fresh ones (attempt %d of %d)", attempt,
                           self._restart_attempts)
            try:
                new = self._restart()  # type: ignore[misc]
            except Exception as exc:
                error = exc
                logger.error("restart attempt %d failed: %s", attempt, exc)
                time.sleep(restart_backoff_s(attempt))
                continue
            with self._cond:
                if self._stopped:
                    new.shutdown()
                    return False
                self.executor = new
                self.restarts += 1
                if self.adapters is not None:
                    self.adapters.workers_replaced()
            logger.warning("fresh workers serving (restart %d)", self.restarts)
            return True
        self._die(f"executor died and {self._restart_attempts} restarts failed: {error}")
        return False

    def _request(self, tick: SchedulerOutput) -> ExecuteBatch | ExecuteStep:
        if self.mode is EngineMode.STEP_BATCH:
            return ExecuteStep(new=tick.new, advance=tick.scheduled_ids, drop=tick.drop_ids,
                               steps=tick.steps, lora_installs=tick.lora_installs,
                               lora_rows=tick.lora_rows,
                               report_state_bytes=self.scheduler.preempting)
        return ExecuteBatch(requests=tick.new, lora_installs=tick.lora_installs,
                            lora_rows=tick.lora_rows)

    def _run_tick(self, tick: SchedulerOutput) -> TickResult | None:
        start = self._clock()
        request = self._request(tick)
        executor = self.executor  # the outputs of this tick are this executor's
        output_ids: dict[str, str] = {}
        text_encoding = None
        prompt_cuts: dict[str, dict[str, int]] = {}
        cache: dict[str, CacheMetrics] = {}
        peak_bytes = free_bytes = None
        preview_index: dict[str, int] = {}
        steps_run = 1
        try:
            with tracing.span(tracing.ENGINE_LOOP_TRACK, str(request.__struct_config__.tag),
                              keys=tick.scheduled_ids, drop=tick.drop_ids):
                ro = executor.execute(request)
            output_ids = dict(ro.output_ids)
            result = _execution_result(tick, ro.reply, output_ids)
            text_encoding = getattr(ro.reply, "text_encoding", None)
            prompt_cuts = dict(getattr(ro.reply, "prompt_tokens_dropped", {}))
            cache = dict(getattr(ro.reply, "cache", {}))
            peak_bytes = getattr(ro.reply, "peak_memory_bytes", None)
            free_bytes = getattr(ro.reply, "free_memory_bytes", None)
            preview_index = dict(getattr(ro.reply, "previews", {}))
            steps_run = getattr(ro.reply, "steps_run", 1)
            if self.adapters is not None:
                self.adapters.slots_empty(list(getattr(ro.reply, "lora_missing", [])))
        except ExecutorDeadError as exc:
            self._installs_unknown(tick)
            if self._restart is None:
                self._die(f"executor died: {exc}")
                return None
            # this tick's requests (and any other running one) fail in
            # _restart_workers, which the loop runs next
            logger.error("executor died: %s", exc)
            return TickResult(scheduled_ids=[], started_at=start, elapsed=self._clock() - start)
        except Exception as exc:  # the runner raised: this tick's requests fail
            self._installs_unknown(tick)
            logger.error("%s failed: %s", type(request).__name__, exc)
            result = ExecutionResult(failed_all=f"{type(exc).__name__}: {exc}")
        elapsed = self._clock() - start
        step_seconds = None if result.failed_all else self._step_seconds(tick, elapsed, steps_run)
        with self._cond:
            ran = self._ran(tick)
            if self._run_time is not None and step_seconds is not None:
                self._run_time.observe(ran, step_seconds)
            rows, tokens = self.scheduler.step_tokens(ran) if step_seconds is not None else (0, 0)
            if self._memory is not None and (peak_bytes is not None or free_bytes is not None):
                self._memory.observe(ran, peak_bytes, free_bytes)
            update = self.scheduler.update_from_output(tick, result)
            done_at = self._clock()
            for event in update.finished:  # the automatic batching window learns from them
                if event.status is RequestStatus.FINISHED and event.admitted_at is not None:
                    self.scheduler.observe_run_time(done_at - event.admitted_at)
        kept: dict[str, OutputRef] = {}
        ended = {event.request_id for event in update.finished}
        previews = {rid: (OutputRef(output_ids.pop(rid), executor), index)
                    for rid, index in preview_index.items()
                    if rid in output_ids and rid not in ended}
        for event in update.finished:
            oid = output_ids.pop(event.request_id, None)
            if oid is not None and event.has_output:
                kept[event.request_id] = OutputRef(oid, executor)
            elif oid is not None:  # produced, but the request failed or was aborted
                executor.release_output(oid)
        for oid in output_ids.values():  # outputs of requests that left already
            executor.release_output(oid)
        return TickResult(scheduled_ids=list(tick.scheduled_ids), started_at=start,
                          elapsed=elapsed, progress=update.progress, finished=update.finished,
                          outputs=kept, previews=previews, step_seconds=step_seconds,
                          steps=steps_run if self.mode is EngineMode.STEP_BATCH else 1,
                          text_encoding=text_encoding, prompt_tokens_dropped=prompt_cuts,
                          cache=cache,
                          step_rows=rows, step_tokens=tokens)

    def _ran(self, tick: SchedulerOutput) -> list[DiffusionRequest]:
        """The requests a tick ran (under the lock, before the scheduler lets
        finished ones go)."""
        if self.mode is not EngineMode.STEP_BATCH:
            return tick.new
        records = (self.scheduler.record(rid) for rid in tick.scheduled_ids)
        return [record.request for record in records if record is not None]

    def _step_seconds(self, tick: SchedulerOutput, elapsed: float,
                      steps_run: int) -> float | None:
        """A step-mode tick ran ``steps_run`` denoise steps; a request-mode tick runs its
        batch's whole step count (one count per batch: it is in the batch key)."""
        if not tick.scheduled_ids:
            return None
        if self.mode is EngineMode.STEP_BATCH:
            return elapsed / max(1, steps_run)  # a tick may carry several steps
        return elapsed / max(1, tick.new[0].sampling_params.denoise_steps())

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
            self._cond.notify_all()
        self._on_dead(reason)
        self.restart_gate.wake()


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


def _execution_result(tick: SchedulerOutput, reply: Any,
                      output_ids: dict[str, str]) -> ExecutionResult:
    """The runner's reply in scheduler terms."""
    match reply:
        case StepDone():
            return ExecutionResult(steps=reply.steps, finished=reply.finished,
                                   errors=reply.errors, state_bytes=reply.state_bytes)
        case BatchDone():
            finished = [rid for rid in tick.scheduled_ids
                        if rid in output_ids and rid not in reply.errors]
            return ExecutionResult(finished=finished, errors=reply.errors)
        case _:
            raise TypeError(f"unexpected runner reply {type(reply).__name__}")
