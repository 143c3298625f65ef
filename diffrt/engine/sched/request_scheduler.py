"""REQUEST_BATCH scheduling: whole-request waves of compatible requests.

One wave runs at a time: ``schedule`` admits up to ``max_num_seqs`` requests
sharing the pipeline's ``request_batch_key`` and the wave leaves the
scheduler in ``update_from_output``. The optional coalescing window (see
``BaseScheduler``) holds back the first schedule of a new wave so a burst can
gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sched.base import BaseScheduler
from diffrt.engine.sched.interface import (
    ExecutionResult,
    Finished,
    SchedulerOutput,
    UpdateResult,
)


class RequestScheduler(BaseScheduler):
    def default_key(self, request: DiffusionRequest) -> tuple:
        return request.sampling_params.request_batch_key()

    def schedule(self, now: float) -> SchedulerOutput | None:
        if self._running:
            return None  # the current wave has not been updated yet
        wave = self._admit(None, self.max_num_seqs, now)
        if not wave:
            return None
        self.policy.waited(self._waiting, now)  # a wave passed them by
        ids = [record.request_id for record in wave]
        self._in_flight.update(ids)
        return SchedulerOutput(new=[record.request for record in wave], scheduled_ids=ids)

    def next_admission_s(self, now: float, step_seconds: Callable[
            [Sequence[DiffusionRequest]], float | None]) -> float | None:
        """The wave ends together: its longest request's steps at the wave's
        step time, less what it has run since its admission."""
        if not self._running:
            return None
        step = step_seconds([record.request for record in self._running])
        if step is None:
            return None
        started = min(r.admitted_at if r.admitted_at is not None else now for r in self._running)
        return max(0.0, max(r.total_steps for r in self._running) * step - (now - started))

    def _update_request(self, record: RequestRecord, result: ExecutionResult, produced: bool,
                        update: UpdateResult) -> None:
        """The wave leaves: every request of it ends here."""
        self._running.remove(record)
        if produced:
            record.step = record.total_steps
        update.finished.append(self._terminal(record, result, produced))

    def _terminal(self, record: RequestRecord, result: ExecutionResult,
                  produced: bool) -> Finished:
        rid = record.request_id
        if record.abort_requested:
            return self._finish(record, RequestStatus.ABORTED)
        if result.failed_all is not None:
            return self._finish(record, RequestStatus.FAILED, error=result.failed_all)
        if rid in result.errors:
            return self._finish(record, RequestStatus.FAILED, error=result.errors[rid])
        if produced:
            return self._finish(record, RequestStatus.FINISHED, has_output=True)
        return self._finish(record, RequestStatus.FAILED, error="runner returned no output")
