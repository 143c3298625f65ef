"""RequestRecord: the engine's one lifecycle record per active request.

The engine creates it at submission and both halves of the engine hold the
same object: the scheduler (inside ``EngineCore``) queues and advances it, the
``OutputProcessor`` delivers its outputs and metrics. Each field has one
writer, guarded by that writer's lock, as marked below; the other side reads
only what is noted. (``StepRequestState`` is a different thing: the worker's
latents and noise-scheduler state for a request in step-batch execution.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffrt.engine.outputs import RequestMetrics
from diffrt.engine.request import DiffusionRequest, OfRequest

if TYPE_CHECKING:
    from diffrt.engine.output_ref import OutputRef
    from diffrt.engine.seats import Seat


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    #: STEP_BATCH: taken out of the running batch for a more urgent request;
    #: its worker keeps its step state until it runs again (``slo``)
    PAUSED = "paused"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(eq=False)
class RequestRecord(OfRequest):
    request: DiffusionRequest
    arrival: float
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    # -- the scheduler's (written under the core's lock) ---------------------------
    status: RequestStatus = RequestStatus.WAITING
    #: compatibility key of the batches this request may join.
    key: tuple = ()
    #: admission order (ties in arrival time).
    seq: int = 0
    #: when it left the waiting queue for its first batch.
    admitted_at: float | None = None
    #: how many younger requests were admitted past this one (aging).
    bypassed: int = 0
    #: scheduler ticks it spent waiting, queued or paused (``slo``'s aging)
    waited_ticks: int = 0
    #: the bytes of its step state in the worker, as its latest tick reported
    state_bytes: int = 0
    #: how often it was paused for a more urgent request
    preemptions: int = 0
    #: denoise steps done; the output processor reads it for terminal outputs.
    step: int = 0
    #: abort arrived while the request was inside an execute call.
    abort_requested: bool = False
    #: its LoRA adapters as (adapter id, scale), resolved and held from when
    #: the core queued it until it ends (``lora.registry``)
    adapters: tuple[tuple[int, float], ...] = ()
    #: the same as (device slot, scale), once admitted to a batch
    adapter_slots: tuple[tuple[int, float], ...] = ()

    # -- set at submission, before the record is shared; the core (its timer) reads them --
    #: when a limit (request_timeout_s, SamplingParams.timeout_s) ends it, and
    #: the error that names the limit
    timeout_at: float | None = None
    timeout_reason: str | None = None
    #: its submitter waits for fresh workers (a restart) until at most
    #: ``timeout_at`` and answers then; the timer leaves it alone meanwhile.
    #: Set before the record is shared, cleared when that wait ends; only the
    #: submitting thread writes it.
    held: bool = False
    #: the server's seat among the waiting (``seats.py``): the core moves it
    #: into the queue with the record and tells it when the record is admitted
    seat: Seat | None = None

    # -- set once by EngineCore.abort, under the core's lock, before the scheduler
    # -- decides; the output processor reads them under its own lock --------------
    #: the user aborted it: a late output is dropped, not delivered.
    aborted: bool = False
    #: an expired limit stopped it: its final output carries this error.
    abort_reason: str | None = None

    # -- the output processor's (written under its lock) ----------------------------
    #: the transformer weights' version it ran on, set by the core when it is
    #: admitted (a weight update waits for the running ones: never two)
    weights_version: int | str = 0
    #: the versions of its LoRA adapters, by name, as it was accepted with them
    lora_versions: dict[str, int | str] = field(default_factory=dict)
    #: the output being moved off the device for it (after COMPUTE_DONE).
    output: OutputRef | None = None
    compute_done_at: float | None = None
    #: wall time of the execute calls it took part in.
    forward_time: float = 0.0
