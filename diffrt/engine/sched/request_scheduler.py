"""REQUEST_BATCH scheduling: whole-request waves of compatible requests.

One wave runs at a time: ``schedule`` admits up to ``max_num_seqs`` requests
sharing the pipeline's ``request_batch_key`` and the wave leaves the
scheduler in ``update_from_output``. The optional coalescing window (see
``BaseScheduler``) holds back the first schedule of a new wave so a burst can
gather.
"""

from __future__ import annotations

from diffrt.engine.record import RequestStatus
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

    def update_from_output(self, output: SchedulerOutput, result: ExecutionResult) -> UpdateResult:
        update = UpdateResult()
        finished_ok = set(result.finished)
        for rid in output.scheduled_ids:
            record = self._requests.get(rid)
            if record is None:
                continue
            self._running.remove(record)
            record.step = record.total_steps if rid in finished_ok else record.step
            update.finished.append(self._terminal(record, rid, result, finished_ok))
        return update

    def _terminal(self, record, rid: str, result: ExecutionResult, finished_ok: set[str]) -> Finished:
        produced = rid in finished_ok
        if record.abort_requested:
            return self._finish(record, RequestStatus.ABORTED)
        if result.failed_all is not None:
            return self._finish(record, RequestStatus.FAILED, error=result.failed_all)
        if rid in result.errors:
            return self._finish(record, RequestStatus.FAILED, error=result.errors[rid])
        if produced:
            return self._finish(record, RequestStatus.FINISHED, has_output=True)
        return self._finish(record, RequestStatus.FAILED, error="runner returned no output")
