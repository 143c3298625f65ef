"""Bookkeeping both schedulers share: the waiting queue, the running set, the
in-flight set of the current execute call, and the terminal transitions."""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable

from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sched.interface import (
    AbortOutcome,
    BatchAdapters,
    BatchMemory,
    ExecutionResult,
    Finished,
    Scheduler,
    SchedulerOutput,
    UpdateResult,
)
from diffrt.engine.sched.policy import AdmissionPolicy, FifoPolicy

#: the automatic window: this share of the recent requests' run time ...
AUTO_WINDOW_FRACTION = 0.1
#: ... and never longer than this
AUTO_WINDOW_MAX_S = 0.05
#: weight of the newest run time in the window's moving average
AUTO_WINDOW_EMA = 0.5


class BaseScheduler(Scheduler):
    """Also owns the coalescing window: when nothing runs, the first schedule of
    a new batch may be held for up to ``max_wait_s`` so a burst can gather. It
    ends when the queue reaches capacity, when no request arrived for
    ``stable_s`` (default: a quarter of the window, at least 1 ms), or at the
    end (the oldest arrival plus ``max_wait_s``); the engine ends it at
    shutdown. Requests that queued behind running work are never held again.

    ``max_wait_s=None`` sizes the window automatically: a tenth of the moving
    average of how long recent requests ran (admission to finish), at most
    50 ms, so a lone request waits at most a quarter of that (``stable_s``)
    while a closed-loop burst — clients resubmitting as a batch finishes —
    gathers into one batch instead of alternating a batch of one with a batch
    of the rest. Nothing is held before the first request finished.

    ``memory`` bounds a batch's estimated peak memory (a ``BatchMemory``:
    ``engine.memory_estimate.MemoryModel``, ``max_batch_memory_bytes``): of the requests
    the policy admits, in its order, those that would push the batch (the
    running requests and those admitted before them) over the budget stay
    waiting, in their place, for a later tick. The first request of an empty
    batch is always admitted, whatever its estimate: a request alone always
    runs, and nothing fails for the budget.

    ``adapters`` gives admitted requests device slots for their LoRA
    adapters (a ``BatchAdapters``: ``engine.lora.registry``); one whose
    adapters find no slot stays waiting, in its place, and so does every
    later one that needs a slot in the same pass (see ``lora.slot_table``)."""

    def __init__(self, max_num_seqs: int = 1, policy: AdmissionPolicy | None = None, *,
                 max_wait_s: float | None = 0.0, stable_s: float | None = None,
                 key: Callable[[DiffusionRequest], tuple] | None = None,
                 memory: BatchMemory | None = None, adapters: BatchAdapters | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_wait_s is not None and max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_num_seqs = max_num_seqs
        #: the compatibility key (the pipeline's; by default the parameters' own)
        self._key = key
        self.policy = policy or FifoPolicy()
        self.memory = memory
        self.adapters = adapters
        self.auto_window = max_wait_s is None
        self._fixed_stable_s = stable_s
        self._run_s_ema: float | None = None
        self.max_wait_s = 0.0
        self.stable_s = 0.0
        self._set_window(max_wait_s or 0.0)
        self._seq = itertools.count()
        self._requests: dict[str, RequestRecord] = {}
        self._waiting: list[RequestRecord] = []  # arrival order
        self._running: list[RequestRecord] = []  # batch order
        #: STEP_BATCH with a preempting policy: taken out of the batch, their
        #: step state kept in the worker (arrival order); empty otherwise
        self._paused: list[RequestRecord] = []
        #: this tick admits nobody less urgent than this (``SloPolicy.on_time``)
        self._urgency_limit: int | None = None
        self._in_flight: set[str] = set()
        self._last_add: float | None = None

    # -- subclasses say which key makes requests compatible ---------------------
    def batch_key(self, request: DiffusionRequest) -> tuple:
        return self._key(request) if self._key is not None else self.default_key(request)

    def default_key(self, request: DiffusionRequest) -> tuple:
        raise NotImplementedError

    # -- public surface -------------------------------------------------------------
    def add(self, record: RequestRecord) -> None:
        rid = record.request_id
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already scheduled")
        record.key = self.batch_key(record.request)
        record.seq = next(self._seq)
        record.status = RequestStatus.WAITING
        self._requests[rid] = record
        self._waiting.append(record)
        self._last_add = record.arrival

    def abort(self, request_id: str) -> tuple[AbortOutcome, Finished | None]:
        record = self._requests.get(request_id)
        if record is None:
            return AbortOutcome.UNKNOWN, None
        if request_id in self._in_flight:
            record.abort_requested = True
            return AbortOutcome.DEFERRED, None
        if record.status is RequestStatus.WAITING:
            self._waiting.remove(record)
        elif record.status is RequestStatus.PAUSED:
            self._paused.remove(record)
            self._on_running_aborted(record)
        else:
            self._running.remove(record)
            self._on_running_aborted(record)
        return AbortOutcome.DONE, self._finish(record, RequestStatus.ABORTED)

    def fail_running(self, error: str) -> list[Finished]:
        """The paused requests too: their state was in the same workers."""
        events = [self._finish(record, RequestStatus.FAILED, error=error)
                  for record in (*self._running, *self._paused)]
        self._running.clear()
        self._paused.clear()
        self._in_flight.clear()
        return events

    def fail_all(self, error: str) -> list[Finished]:
        events = [self._finish(record, RequestStatus.FAILED, error=error)
                  for record in list(self._requests.values())]
        self._waiting.clear()
        self._running.clear()
        self._paused.clear()
        self._in_flight.clear()
        return events

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._paused)

    def lateness(self, record: RequestRecord, now: float) -> float | None:
        """As the policy judges it (``AdmissionPolicy.lateness``), beside the
        running requests and the queued or paused ones."""
        return self.policy.lateness(record, self._running, [*self._waiting, *self._paused],
                                    self.preempting, now)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def record(self, request_id: str) -> RequestRecord | None:
        return self._requests.get(request_id)

    def _set_window(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.stable_s = (self._fixed_stable_s if self._fixed_stable_s is not None
                         else max(0.001, max_wait_s / 4))

    def observe_run_time(self, seconds: float) -> None:
        """A request ran ``seconds`` from admission to its end: the automatic
        window follows the moving average (a fixed window ignores it)."""
        if not self.auto_window or seconds < 0:
            return
        ema = self._run_s_ema
        ema = seconds if ema is None else (1 - AUTO_WINDOW_EMA) * ema + AUTO_WINDOW_EMA * seconds
        self._run_s_ema = ema
        self._set_window(min(AUTO_WINDOW_MAX_S, AUTO_WINDOW_FRACTION * ema))

    def forget_run_times(self) -> None:
        if self.auto_window:
            self._run_s_ema = None
            self._set_window(0.0)

    def admission_wait_s(self, now: float) -> float:
        if self.max_wait_s <= 0 or self._running or self._paused or not self._waiting:
            return 0.0
        if len(self._waiting) >= self.max_num_seqs:
            return 0.0
        window_end = self._waiting[0].arrival + self.max_wait_s
        stable_at = (self._last_add if self._last_add is not None else now) + self.stable_s
        return max(0.0, min(window_end, stable_at) - now)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def paused_state_bytes(self) -> int:
        """What the paused requests' step state holds in the workers, as
        their latest ticks reported it."""
        return sum(record.state_bytes for record in self._paused)

    # -- helpers ------------------------------------------------------------------
    def _admit(self, key: tuple | None, capacity: int, now: float) -> list[RequestRecord]:
        """Admit what the policy picks of the waiting and paused requests
        (within the budgets and LoRA slots) into the running set. A resumed
        paused request keeps its first ``admitted_at``."""
        candidates = [*self._waiting, *self._paused] if self._paused else self._waiting
        if self.holding:  # a job between ticks waits for the running ones: none joins
            candidates = list(self._paused)
        if self._urgency_limit is not None:  # this tick's steps are kept short for a deadline
            candidates = [r for r in candidates if self.policy.urgency(r) <= self._urgency_limit]
        chosen = self._with_slots(self._within_budget(
            self.policy.select(candidates, key, capacity, now)))
        if chosen:
            ids = {id(record) for record in chosen}
            self._waiting = [record for record in self._waiting if id(record) not in ids]
            self._paused = [record for record in self._paused if id(record) not in ids]
            for record in chosen:
                record.status = RequestStatus.RUNNING
                if record.admitted_at is None:
                    record.admitted_at = now
            self._running.extend(chosen)
        return chosen

    def batch_memory(self) -> int:
        """The running requests' estimated peak memory, in bytes (0 without an estimate)."""
        memory = self.memory
        return sum(memory.estimate(r.request) for r in self._running) if memory else 0

    def _within_budget(self, chosen: list[RequestRecord]) -> list[RequestRecord]:
        """The prefix of ``chosen`` that keeps the batch within the memory
        budget (the rest waits); never empty when nothing runs and ``chosen`` is not."""
        memory = self.memory
        budget = memory.budget if memory is not None else None
        if memory is None or budget is None or not chosen:
            return chosen
        used = self.batch_memory()
        kept: list[RequestRecord] = []
        for record in chosen:
            need = memory.estimate(record.request)
            if used + need > budget and (self._running or kept):
                break
            kept.append(record)
            used += need
        return kept

    def _with_slots(self, chosen: list[RequestRecord]) -> list[RequestRecord]:
        """Those of ``chosen`` whose adapters have device slots now (the rest wait)."""
        if self.adapters is None:
            return chosen
        kept, blocked = [], False
        for record in chosen:
            if self.adapters.admit(record, blocked=blocked):
                kept.append(record)
            else:
                blocked = True
        return kept

    def _on_running_aborted(self, record: RequestRecord) -> None:
        """A running request (not in flight) was aborted: STEP_BATCH drops its state."""

    def update_from_output(self, output: SchedulerOutput, result: ExecutionResult) -> UpdateResult:
        """Apply an execute call's result to each request it ran that is still
        here (``_update_request``, the mode's own transitions)."""
        update = UpdateResult()
        finished_ok = set(result.finished)
        for rid in output.scheduled_ids:
            record = self._requests.get(rid)
            if record is not None:
                self._update_request(record, result, rid in finished_ok, update)
        return update

    @abstractmethod
    def _update_request(self, record: RequestRecord, result: ExecutionResult, produced: bool,
                        update: UpdateResult) -> None:
        """``record`` ran in the call ``result`` reports (``produced``: its
        output came): its progress and terminal event go into ``update``."""

    def _finish(self, record: RequestRecord, status: RequestStatus, *, error: str | None = None,
                has_output: bool = False) -> Finished:
        record.status = status
        self._requests.pop(record.request_id, None)
        self._in_flight.discard(record.request_id)
        if self.adapters is not None:
            self.adapters.release(record)
        return Finished(record.request_id, status, error=error, has_output=has_output,
                        step=record.step, total_steps=record.total_steps, admitted_at=record.admitted_at)
