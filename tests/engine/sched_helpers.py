"""Request builders for the pure scheduler tests (no model, no threads)."""

from __future__ import annotations

from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.sched import ExecutionResult, SchedulerOutput


def req(rid: str, size: int = 64, steps: int = 2, **kw) -> DiffusionRequest:
    return DiffusionRequest(
        prompt=rid, request_id=rid,
        sampling_params=SamplingParams(height=size, width=size, num_inference_steps=steps, **kw),
    )


def all_done(out: SchedulerOutput) -> ExecutionResult:
    return ExecutionResult(finished=list(out.scheduled_ids))
