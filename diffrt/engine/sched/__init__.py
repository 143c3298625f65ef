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
from diffrt.engine.sched.policy import POLICIES, AdmissionPolicy, FifoPolicy, SkipAheadPolicy
from diffrt.engine.sched.request_scheduler import RequestScheduler
from diffrt.engine.sched.slo import SloPolicy, StepCost
from diffrt.engine.sched.step_scheduler import StepScheduler


def make_policy(name: str, *, max_bypass: int = 4, aging_ticks: int = 16,
                cost: StepCost | None = None) -> AdmissionPolicy:
    """The policy ``name`` (``scheduling_policy``); ``cost`` estimates the
    remaining work ``slo`` ranks by (the engine's ``RunTimeModel``; None:
    slack is the time left to the deadline)."""
    if name == "fifo":
        return FifoPolicy()
    if name == "skip_ahead":
        return SkipAheadPolicy(max_bypass)
    if name == "slo":
        return SloPolicy(aging_ticks, cost)
    raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {name!r}")

__all__ = [
    "POLICIES",
    "AbortOutcome",
    "AdmissionPolicy",
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
    "SloPolicy",
    "StepCost",
    "StepScheduler",
    "UpdateResult",
    "make_policy",
]
