"""EngineCore on its own, against a scripted executor: what a tick reports and
what it frees, without streams, threads of a real executor, or a model."""

from __future__ import annotations

import queue
from typing import Any

import pytest
from engine_helpers import toy_request

from diffrt.engine.config import ExecutionMode
from diffrt.engine.core import EngineCore, TickResult
from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.runner_messages import (
    CountStepStates,
    ExecuteBatch,
    ExecuteStep,
    StepReport,
    TickReport,
)
from diffrt.engine.sched import RequestScheduler, StepScheduler
from diffrt.runtime.types import ExecutorDeadError, RunnerOutput, WorkerError


class ScriptedExecutor:
    """Answers each execute with the next scripted reply (or raises it)."""

    def __init__(self, replies: list[Any]):
        self.replies = list(replies)
        self.requests: list[Any] = []
        self.released: list[str] = []

    def execute(self, request: Any, timeout: float | None = None) -> RunnerOutput:
        self.requests.append(request)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def release_output(self, output_id: str) -> None:
        self.released.append(output_id)

    def shutdown(self) -> None:
        pass


def run_core(mode: ExecutionMode, scheduler, executor, records: list[RequestRecord],
             ticks: int) -> tuple[list[TickResult], list[str]]:
    events: queue.Queue = queue.Queue()  # TickResults, or the reason the core died
    core = EngineCore(mode, scheduler, executor, on_tick=events.put, on_dead=events.put)
    core.start()
    assert core.add(records)
    got: list[TickResult] = []
    dead: list[str] = []
    while len(got) < ticks and not dead:
        event = events.get(timeout=10)
        (dead if isinstance(event, str) else got).append(event)
    core.stop(grace_s=5.0)
    return got, dead


def records(*rids: str, steps: int = 2) -> list[RequestRecord]:
    return [RequestRecord(toy_request(rid=r, steps=steps), arrival=0.0) for r in rids]


def test_a_request_batch_tick_reports_finished_ids_with_their_output_ids():
    ex = ScriptedExecutor([RunnerOutput(TickReport(errors={"b": "boom"}), "out-1",
                                        {"a": "out-1/0", "b": "out-1/1"})])
    recs = records("a", "b")
    [tick], dead = run_core(ExecutionMode.REQUEST_BATCH, RequestScheduler(2), ex, recs, 1)
    assert not dead
    assert isinstance(ex.requests[0], ExecuteBatch)
    assert [r.request_id for r in ex.requests[0].requests] == ["a", "b"]
    assert tick.scheduled_ids == ["a", "b"]
    by_id = {e.request_id: e for e in tick.finished}
    assert by_id["a"].status is RequestStatus.FINISHED
    assert {rid: ref.output_id for rid, ref in tick.outputs.items()} == {"a": "out-1/0"}
    assert tick.outputs["a"].executor is ex  # the output travels with its executor
    assert by_id["b"].status is RequestStatus.FAILED and by_id["b"].error == "boom"
    assert ex.released == ["out-1/1"]  # produced for a failed request: nobody reads it
    assert all(r.admitted_at is not None for r in recs)


def test_step_ticks_report_progress_then_the_finish():
    ex = ScriptedExecutor([
        RunnerOutput(TickReport(step=StepReport(steps={"a": 1})), None, {}),
        RunnerOutput(TickReport(step=StepReport(finished=["a"])), "out-2", {"a": "out-2/0"}),
    ])
    ticks, dead = run_core(ExecutionMode.STEP_BATCH, StepScheduler(2), ex, records("a"), 2)
    assert not dead
    assert isinstance(ex.requests[0], ExecuteStep) and [r.request_id for r in ex.requests[0].new] == ["a"]
    assert ex.requests[1] == ExecuteStep(new=[], advance=["a"], drop=[])
    assert [(p.request_id, p.step) for p in ticks[0].progress] == [("a", 1)]
    assert {rid: ref.output_id for rid, ref in ticks[1].outputs.items()} == {"a": "out-2/0"}
    assert ticks[1].finished[0].step == 2


def test_a_runner_error_fails_the_tick_and_a_dead_executor_kills_the_core():
    ex = ScriptedExecutor([WorkerError("rank 0: broken"), ExecutorDeadError("worker gone")])
    [tick], dead = run_core(ExecutionMode.REQUEST_BATCH, RequestScheduler(1), ex,
                            records("a", "b"), 2)
    assert tick.finished[0].status is RequestStatus.FAILED and "broken" in tick.finished[0].error
    assert dead == ["executor died: worker gone"]


def test_an_unexpected_reply_fails_the_tick_not_the_engine():
    ex = ScriptedExecutor([RunnerOutput(CountStepStates(), None, {})])
    [tick], dead = run_core(ExecutionMode.REQUEST_BATCH, RequestScheduler(1), ex, records("a"), 1)
    assert not dead
    assert tick.finished[0].status is RequestStatus.FAILED
    assert "unexpected runner reply CountStepStates" in tick.finished[0].error


def test_the_engine_refuses_a_request_its_runner_does_not_declare(req_engine1):
    with pytest.raises(TypeError, match="not a request of this runner"):
        req_engine1.executor.execute(TickReport())
    assert req_engine1.is_healthy()


def test_an_abort_is_one_call_whose_outcome_comes_back_as_a_report():
    """The core decides an abort and reports it through on_tick: a queued
    request ends at once (DONE, its terminal event in the notice); a record
    aborted before it reached the core (an abort racing its submission) is
    never queued; the limit's reason is on the record before the scheduler
    decides, so a tick that ends it meanwhile reports the timeout."""
    from diffrt.engine.sched import AbortOutcome

    events: queue.Queue = queue.Queue()
    core = EngineCore(ExecutionMode.REQUEST_BATCH, RequestScheduler(1), ScriptedExecutor([]),
                      on_tick=events.put, on_dead=events.put)
    queued, racing = records("queued", "racing")
    with core._cond:  # no loop thread: the scheduler stays as add() leaves it
        core.scheduler.add(queued)
    core.abort("queued", "request timed out after 1 s (timeout_s=1)", queued)
    [notice] = events.get(timeout=5).aborts
    assert notice.outcome is AbortOutcome.DONE and notice.event.request_id == "queued"
    assert queued.aborted and queued.abort_reason.startswith("request timed out")
    core.abort("racing", None, racing)  # before add: nothing scheduled
    assert events.get(timeout=5).aborts[0].outcome is AbortOutcome.UNKNOWN
    assert core.add([racing]) and not core.scheduler.has_request("racing")
    core.stop(grace_s=1.0)
