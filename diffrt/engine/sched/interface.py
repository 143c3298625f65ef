"""What the schedulers share: the scheduler contract, tick results, events.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from diffrt.engine.errors import DeadlineUnmeetableError
from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.request import DiffusionRequest


class BatchMemory(Protocol):
    """What a scheduler needs to keep a batch's memory bounded: a request's
    estimated peak, in bytes, and the budget of a batch (None: unbounded).
    The engine's is ``engine.memory_estimate.MemoryModel``."""

    budget: int | None

    def estimate(self, request: DiffusionRequest) -> int: ...


class BatchAdapters(Protocol):
    """What a scheduler needs of LoRA adapters: device slots for a request's
    adapters before it joins a batch (False: none free now; it waits), the
    same question asked without taking them (``could_admit``: whether pausing
    others for it helps), and their release when it ends. The engine's is
    ``engine.lora.registry.AdapterRegistry``."""

    def admit(self, record: RequestRecord, *, blocked: bool) -> bool: ...

    def could_admit(self, record: RequestRecord) -> bool: ...

    def release(self, record: RequestRecord) -> None: ...


@dataclass
class ExecutionResult:
    """What one execute call reported, in scheduler terms."""

    #: request id -> denoise steps done after this tick (STEP_BATCH).
    steps: dict[str, int] = field(default_factory=dict)
    #: ids whose output was produced in this call.
    finished: list[str] = field(default_factory=list)
    #: request id -> error message for requests that failed in this call.
    errors: dict[str, str] = field(default_factory=dict)
    #: the whole call failed (runner raised): every scheduled request fails.
    failed_all: str | None = None
    #: request id -> bytes of its step state in the worker (STEP_BATCH, running ones)
    state_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class Progress:
    request_id: str
    step: int
    total_steps: int


@dataclass
class Finished:
    """A terminal scheduler event: the request leaves the scheduler."""

    request_id: str
    status: RequestStatus
    error: str | None = None
    #: the execute call produced an output the engine must collect (any other
    #: output produced for this request is freed).
    has_output: bool = False
    step: int = 0
    total_steps: int = 0
    #: when it was admitted (None: it never ran), on the clock ``schedule`` is given
    admitted_at: float | None = None


@dataclass
class UpdateResult:
    progress: list[Progress] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)


class AbortOutcome(enum.Enum):
    #: not known to the scheduler (never added, or already left it).
    UNKNOWN = "unknown"
    #: removed at once; the returned Finished event is terminal.
    DONE = "done"
    #: inside an execute call: finalised by the next update_from_output.
    DEFERRED = "deferred"


@dataclass
class SchedulerOutput:
    """One tick's work. ``new`` requests are sent in full, the others by id."""

    new: list[DiffusionRequest] = field(default_factory=list)
    #: ids to run/advance in this call, in batch order (new ones included).
    scheduled_ids: list[str] = field(default_factory=list)
    #: ids whose worker-side state must be dropped (STEP_BATCH).
    drop_ids: list[str] = field(default_factory=list)
    #: STEP_BATCH: denoise steps the worker may run in this call (it stops
    #: early after a step that finishes a request or reaches a preview)
    steps: int = 1
    #: LoRA (set by the engine's core): device slot -> adapter id to install
    #: first, and the (slot, adapter id, scale) of the admitted requests' adapters
    adapter_installs: dict[int, int] = field(default_factory=dict)
    request_adapters: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_ids and not self.drop_ids


class Scheduler(ABC):
    """Common surface of RequestScheduler and StepScheduler.

    Schedulers are pure bookkeeping: they never touch the executor, threads or
    clocks of their own (the engine passes ``now``), so every admission and
    lifecycle rule is testable without a model.
    """

    #: where a scheduler has it, the device slots its admitted requests' adapters
    #: take (``BaseScheduler``'s); one given to the engine with None gets the engine's
    adapters: BatchAdapters | None
    #: a job between ticks waits for the running requests to finish (a weight
    #: update, sleep: ``engine.between_ticks``): admit no new request
    #: meanwhile (a paused one may resume and finish)
    holding: bool = False

    @abstractmethod
    def add(self, record: RequestRecord) -> None:
        """Queue ``record`` (its ``arrival`` is the queueing time)."""

    def add_request(self, request: DiffusionRequest, now: float) -> RequestRecord:
        """Queue a new record for ``request`` arriving at ``now``."""
        record = RequestRecord(request, arrival=now)
        self.add(record)
        return record

    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput | None:
        """Work for the next execute call, or None when there is none."""

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, result: ExecutionResult) -> UpdateResult:
        """Apply an execute call's result; terminal events always finalise state."""

    @abstractmethod
    def abort(self, request_id: str) -> tuple[AbortOutcome, Finished | None]: ...

    @abstractmethod
    def fail_running(self, error: str) -> list[Finished]:
        """End the requests in a batch (their state died with a worker); the
        waiting ones stay queued for the next workers."""

    @abstractmethod
    def fail_all(self, error: str) -> list[Finished]:
        """Executor gone: every request leaves the scheduler as failed."""

    @abstractmethod
    def has_work(self) -> bool: ...

    @abstractmethod
    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` is queued or running here."""

    @property
    def preempting(self) -> bool:
        """Running requests may be paused for more urgent ones (STEP_BATCH
        with a preempting policy)."""
        return False

    def lateness(self, record: RequestRecord, now: float) -> float | None:
        """Seconds past its deadline ``record`` would finish if queued at
        ``now`` (<= 0: in time); None where the scheduler cannot tell."""
        return None

    def refuse_if_late(self, record: RequestRecord, now: float) -> None:
        """``DeadlineUnmeetableError`` when the queue ahead and its own work
        would take ``record`` past its deadline (``refuse_unmeetable``)."""
        late = self.lateness(record, now)
        if late is None or late <= 0:
            return
        deadline = record.request.sampling_params.deadline_s
        retry = max(1.0, math.ceil(late))
        raise DeadlineUnmeetableError(
            f"deadline_s: with the work queued ahead it would finish about {late:.2g} s after "
            f"its deadline of {deadline:g} s (refuse_unmeetable); retry in {retry:.0f} s",
            retry_after_s=retry)

    def step_tokens(self, requests: list[DiffusionRequest]) -> tuple[int, int]:
        """(rows, tokens computed) of one step of ``requests`` (what the stats
        count); (0, 0) where the scheduler does not count them."""
        return 0, 0

    @abstractmethod
    def record(self, request_id: str) -> RequestRecord | None:
        """The record of ``request_id`` while it is queued or running here."""

    def next_admission_s(self, now: float, step_seconds: Callable[
            [Sequence[DiffusionRequest]], float | None]) -> float | None:
        """Predicted seconds until a waiting request is next admitted (a seat
        among the waiting frees), with ``step_seconds`` the predicted time of
        a step of the given requests (the step-cost model's, momentary);
        None when nothing runs or there is no prediction yet. What a server
        shedding for a full queue suggests as Retry-After."""
        return None

    def admission_wait_s(self, now: float) -> float:
        """Seconds the engine should still hold back the next schedule()."""
        return 0.0

    def observe_run_time(self, seconds: float) -> None:
        """A request finished ``seconds`` after its admission (a scheduler that
        sizes its batching window from run times listens; others ignore it)."""
        return None

    def forget_run_times(self) -> None:
        """Drop what ``observe_run_time`` learnt (e.g. from the warm-up request)."""
        return None

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    def num_paused(self) -> int:
        """Requests taken out of the running batch whose worker keeps their state."""
        return 0

    def paused_state_bytes(self) -> int:
        return 0

    #: running requests paused for more urgent ones, since start
    preemptions: int = 0
