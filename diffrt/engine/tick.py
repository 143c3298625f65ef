"""One engine tick's parts outside the core's loop: the request it sends,
the runner's ``TickReport`` read in scheduler terms, and what the core
reports (``TickResult``, ``AbortNotice``) with the tick's outputs routed —
kept for the requests that finished with one, freed for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrt.engine.config import ExecutionMode
from diffrt.engine.output_ref import OutputRef
from diffrt.engine.outputs import CacheMetrics, TextEncoderStats
from diffrt.engine.record import RequestRecord
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.runner_messages import ExecuteBatch, ExecuteStep, TickReport
from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    Finished,
    Progress,
    Scheduler,
    SchedulerOutput,
    UpdateResult,
)
from diffrt.runtime.executor import Executor


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
    #: the step-cost model's prediction of ``elapsed`` before it ran (None: none yet)
    predicted_s: float | None = None
    #: request id -> text encoder -> prompt tokens it cut (``TickReport``)
    prompt_tokens_dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    #: request id -> what its step cache did, for requests that finished with one
    cache: dict[str, CacheMetrics] = field(default_factory=dict)


@dataclass
class Executed:
    """One tick's execute call as the core saw it: the runner's report (an
    empty one when the call raised) and the outputs it produced."""

    started_at: float
    elapsed: float
    #: the executor that ran it: the tick's outputs are its
    executor: Executor
    report: TickReport = field(default_factory=TickReport)
    #: request id -> output id, for the outputs on their way to host memory
    output_ids: dict[str, str] = field(default_factory=dict)
    #: the whole call failed (the runner raised): every request of it fails
    failed_all: str | None = None
    #: the executor died under it (restarts on: the restart fails its requests)
    dead: bool = False
    #: the step-cost model's prediction of ``elapsed`` (set when the tick is observed)
    predicted_s: float | None = None

    @property
    def steps_run(self) -> int:
        return self.report.step.steps_run if self.report.step is not None else 1


def tick_request(mode: ExecutionMode, tick: SchedulerOutput, *,
                 report_state_bytes: bool) -> ExecuteBatch | ExecuteStep:
    """The typed request that carries ``tick`` to the workers."""
    if mode is ExecutionMode.STEP_BATCH:
        return ExecuteStep(new=tick.new, advance=tick.scheduled_ids, drop=tick.drop_ids,
                           steps=tick.steps, adapter_installs=tick.adapter_installs,
                           request_adapters=tick.request_adapters, report_state_bytes=report_state_bytes)
    return ExecuteBatch(requests=tick.new, adapter_installs=tick.adapter_installs,
                        request_adapters=tick.request_adapters)


def ran_requests(mode: ExecutionMode, tick: SchedulerOutput,
                 scheduler: Scheduler) -> list[DiffusionRequest]:
    """The requests ``tick`` ran (under the core's lock, before the scheduler
    lets finished ones go)."""
    if mode is not ExecutionMode.STEP_BATCH:
        return tick.new
    records = (scheduler.record(rid) for rid in tick.scheduled_ids)
    return [record.request for record in records if record is not None]


def seconds_per_step(mode: ExecutionMode, tick: SchedulerOutput, ran: Executed) -> float | None:
    """Seconds a denoise step took in ``tick``: a step-batch tick ran
    ``steps_run`` steps (a tick may carry several); a request-batch tick runs
    its batch's whole step count (one count per batch: it is in the batch key)."""
    if not tick.scheduled_ids:
        return None
    if mode is ExecutionMode.STEP_BATCH:
        return ran.elapsed / max(1, ran.steps_run)
    return ran.elapsed / max(1, tick.new[0].sampling_params.denoise_steps())


def read_report(reply: object) -> TickReport:
    """The runner's reply to an execute; TypeError for anything else."""
    if not isinstance(reply, TickReport):
        raise TypeError(f"unexpected runner reply {type(reply).__name__}")
    return reply


def execution_result(tick: SchedulerOutput, ran: Executed) -> ExecutionResult:
    """The runner's report in scheduler terms. REQUEST_BATCH: a request
    finished when its output came and it has no error."""
    report = ran.report
    if ran.failed_all is not None:
        return ExecutionResult(failed_all=ran.failed_all)
    if report.step is not None:
        return ExecutionResult(steps=report.step.steps, finished=report.step.finished,
                               errors=report.errors, state_bytes=report.step.state_bytes)
    finished = [rid for rid in tick.scheduled_ids
                if rid in ran.output_ids and rid not in report.errors]
    return ExecutionResult(finished=finished, errors=report.errors)


def route_outputs(update: UpdateResult, ran: Executed
                  ) -> tuple[dict[str, OutputRef], dict[str, tuple[OutputRef, int]]]:
    """The tick's outputs: (final outputs of the requests that finished with
    one, previews of those still running); every other output is freed (a
    failed or aborted request's, one of a request that left already)."""
    executor, output_ids = ran.executor, dict(ran.output_ids)
    ended = {event.request_id for event in update.finished}
    indices = ran.report.step.previews if ran.report.step is not None else {}
    previews = {rid: (OutputRef(output_ids.pop(rid), executor), index)
                for rid, index in indices.items() if rid in output_ids and rid not in ended}
    kept: dict[str, OutputRef] = {}
    for event in update.finished:
        oid = output_ids.pop(event.request_id, None)
        if oid is not None and event.has_output:
            kept[event.request_id] = OutputRef(oid, executor)
        elif oid is not None:  # produced, but the request failed or was aborted
            executor.release_output(oid)
    for oid in output_ids.values():  # outputs of requests that left already
        executor.release_output(oid)
    return kept, previews


__all__ = ["AbortNotice", "Executed", "TickResult", "execution_result", "ran_requests",
           "read_report", "route_outputs", "seconds_per_step", "tick_request"]
