"""REQUEST_BATCH scheduling: whole-request waves of compatible requests.

One wave runs at a time: ``schedule`` admits up to ``max_num_seqs`` requests
sharing ``SamplingParams.request_batch_key()`` and the wave leaves the
scheduler in ``update_from_output``. An optional coalescing window
(``max_wait_s``) holds back the first schedule of a new wave so a burst can
gather; it ends when the queue reaches capacity, when the queue has stopped
growing for ``stable_s``, or at the deadline (the oldest arrival plus
``max_wait_s``). The engine ends it at shutdown.
"""

from __future__ import annotations

from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sched.base import BaseScheduler
from diffrt.engine.sched.interface import (
    ExecutionResult,
    Finished,
    RequestStatus,
    SchedulerOutput,
    UpdateResult,
)
from diffrt.engine.sched.policy import AdmissionPolicy


class RequestScheduler(BaseScheduler):
    def __init__(self, max_num_seqs: int = 1, policy: AdmissionPolicy | None = None, *,
                 max_wait_s: float = 0.0, stable_s: float | None = None):
        super().__init__(max_num_seqs, policy)
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        # "Stabilised" = no arrival for a quarter of the window (at least 1 ms).
        self.stable_s = stable_s if stable_s is not None else max(0.001, max_wait_s / 4)

    def batch_key(self, request: DiffusionRequest) -> tuple:
        return request.sampling_params.request_batch_key()

    def admission_wait_s(self, now: float) -> float:
        if self.max_wait_s <= 0 or self._running or not self._waiting:
            return 0.0
        if len(self._waiting) >= self.max_num_seqs:
            return 0.0
        deadline = self._waiting[0].arrival + self.max_wait_s
        stable_at = (self._last_add if self._last_add is not None else now) + self.stable_s
        return max(0.0, min(deadline, stable_at) - now)

    def schedule(self, now: float) -> SchedulerOutput | None:
        if self._running:
            return None  # the current wave has not been updated yet
        wave = self._admit(None, self.max_num_seqs, now)
        if not wave:
            return None
        ids = [sr.request_id for sr in wave]
        self._in_flight.update(ids)
        return SchedulerOutput(new=[sr.request for sr in wave], scheduled_ids=ids)

    def update_from_output(self, output: SchedulerOutput, result: ExecutionResult) -> UpdateResult:
        update = UpdateResult()
        finished_ok = set(result.finished)
        for rid in output.scheduled_ids:
            sr = self._requests.get(rid)
            if sr is None:
                continue
            self._running.remove(sr)
            sr.step = sr.total_steps if rid in finished_ok else sr.step
            update.finished.append(self._terminal(sr, rid, result, finished_ok))
        return update

    def _terminal(self, sr, rid: str, result: ExecutionResult, finished_ok: set[str]) -> Finished:
        produced = rid in finished_ok
        if sr.abort_requested:
            return self._finish(sr, RequestStatus.ABORTED, release_output=produced)
        if result.failed_all is not None:
            return self._finish(sr, RequestStatus.FAILED, error=result.failed_all,
                                release_output=produced)
        if rid in result.errors:
            return self._finish(sr, RequestStatus.FAILED, error=result.errors[rid],
                                release_output=produced)
        if produced:
            return self._finish(sr, RequestStatus.FINISHED, has_output=True)
        return self._finish(sr, RequestStatus.FAILED, error="runner returned no output")
