"""Schedulers: RequestScheduler (REQUEST_BATCH) and StepScheduler (STEP_BATCH)."""

from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.sched.interface import (
    AbortOutcome,
    ExecutionResult,
    Finished,
    Progress,
    Scheduler,
    SchedulerOutput,
    UpdateResult,
)
from diffrt.engine.sched.policy import POLICIES, FifoPolicy, SkipAheadPolicy, make_policy
from diffrt.engine.sched.request_scheduler import RequestScheduler
from diffrt.engine.sched.step_scheduler import StepScheduler

__all__ = [
    "POLICIES",
    "AbortOutcome",
    "ExecutionResult",
    "FifoPolicy",
    "Finished",
    "Progress",
    "RequestScheduler",
    "RequestStatus",
    "RequestRecord",
    "Scheduler",
    "SchedulerOutput",
    "SkipAheadPolicy",
    "StepScheduler",
    "UpdateResult",
    "make_policy",
]
