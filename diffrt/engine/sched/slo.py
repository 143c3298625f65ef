"""The ``slo`` policy: priority first, then least slack to the deadline, with aging.

Every request ranks by ``(urgency, lost, slack, seq)``, smallest first:

* ``urgency`` is its ``SamplingParams.priority`` (lower runs first, vLLM's
  convention) less one for every ``aging_ticks`` scheduler ticks it has
  aged (``RequestRecord.waited_ticks``; a tick is a schedule that ran). A
  request ages while it waits, queued or paused, without a deadline or past
  it; before its deadline its slack speaks for it (aging it then would put
  work that can still wait above another class's promise). Among aging
  requests urgency orders by the tick aging began + priority x
  ``aging_ticks``, a FIFO on that virtual arrival: a request of priority
  ``p`` is passed by aging requests of priority ``q`` only if they began
  aging less than ``(p - q) * aging_ticks`` ticks after it, and by requests
  within their deadline (urgency >= -10) for at most ``(p + 11) *
  aging_ticks`` ticks of its aging. So a sustained stream of urgent requests
  cannot starve it. Ticks, not seconds, so the order is deterministic.
* ``lost``: within a class the requests that can still meet their deadline
  go first; those without one and those that cannot (negative slack) follow
  in arrival order (``seq``), so under overload the latest request does not
  go first and make every one behind it late too (EDF's domino effect).
* ``slack`` is ``deadline - now - remaining work``: the seconds it could
  still wait and meet its ``deadline_s`` (counted from its arrival). The
  remaining work is its remaining denoise steps times its step time alone
  from the engine's step-cost model (``StepCost``: the ``RunTimeModel``'s
  per-step overhead plus its rows' work, CFG doubling its rows); before a
  fit it is the time to the deadline.
* ``seq`` (arrival order) breaks ties.

``urgency`` also decides preemption (``StepScheduler``): a running request is
paused only for a waiting one of strictly smaller urgency, never within a
class, so two requests of one class never take turns. A request of another
batch key that is passed over keeps the less urgent ones from joining
(``select``), so the running batch drains for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

from diffrt.engine.record import RequestRecord
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sched.policy import AdmissionPolicy


class StepCost(Protocol):
    """What ``slo`` needs of the step-cost model (``engine.run_time.RunTimeModel``):
    the seconds a step costs whatever its rows (None before a fit), and the
    seconds a request's rows add to a step."""

    @property
    def step_overhead(self) -> float | None: ...

    def work_seconds(self, request: DiffusionRequest) -> float: ...


def remaining_steps(record: RequestRecord) -> int:
    return max(0, record.total_steps - record.step)


class SloPolicy(AdmissionPolicy):
    name = "slo"
    preempts = True

    def __init__(self, aging_ticks: int = 16, cost: StepCost | None = None):
        if aging_ticks < 1:
            raise ValueError(f"aging_ticks must be >= 1, got {aging_ticks}")
        self.aging_ticks = aging_ticks
        self.cost = cost

    # -- ranking ----------------------------------------------------------------------
    def urgency(self, record: RequestRecord) -> int:
        return record.request.sampling_params.priority - record.waited_ticks // self.aging_ticks

    def remaining_s(self, record: RequestRecord, *, overhead: bool = True) -> float:
        """Its remaining steps at its step time alone (0 before the model has
        measured a tick); ``overhead=False``: its own work only, without the
        per-step overhead a batch pays once."""
        cost = self.cost
        o = cost.step_overhead if cost is not None else None
        if cost is None or o is None:
            return 0.0
        per_step = (o if overhead else 0.0) + cost.work_seconds(record.request)
        return remaining_steps(record) * per_step

    def slack(self, record: RequestRecord, now: float) -> float:
        deadline = record.request.sampling_params.deadline_s
        if deadline is None:
            return math.inf
        return record.arrival + deadline - now - self.remaining_s(record)

    def rank(self, record: RequestRecord, now: float) -> tuple[int, bool, float, int]:
        """Within a class, requests that can still meet their deadline first,
        least slack first; then the rest in arrival order: those without one
        and those that are lost (negative slack), so the latest request does
        not go first and make the ones behind it late too (EDF's domino
        effect under overload)."""
        slack = self.slack(record, now)
        feasible = 0 <= slack < math.inf
        return self.urgency(record), not feasible, slack if feasible else 0.0, record.seq

    def ordered(self, records: Sequence[RequestRecord], now: float) -> list[RequestRecord]:
        """``records``, most urgent first."""
        return sorted(records, key=lambda r: self.rank(r, now))

    # -- the policy ---------------------------------------------------------------------
    def select(self, waiting: Sequence[RequestRecord], key: tuple | None, capacity: int,
               now: float = 0.0) -> list[RequestRecord]:
        if capacity <= 0 or not waiting:
            return []
        ordered = self.ordered(waiting, now)
        if key is None:
            key = ordered[0].key
        chosen: list[RequestRecord] = []
        blocking: int | None = None  # the urgency of a passed-over request of another key
        for record in ordered:
            if blocking is not None and self.urgency(record) > blocking:
                break  # less urgent than it: they wait with it for the batch to drain
            if record.key != key:
                blocking = self.urgency(record) if blocking is None else blocking
                continue
            chosen.append(record)
            if len(chosen) == capacity:
                break
        return chosen

    def waited(self, records: Sequence[RequestRecord], now: float) -> None:
        """A request ages while it has no deadline or its deadline has passed:
        before that its slack speaks for it, and aging it then would rank
        work that can still wait above another class's promise."""
        for record in records:
            deadline = record.request.sampling_params.deadline_s
            if deadline is None or now > record.arrival + deadline:
                record.waited_ticks += 1

    # -- the step's size for the deadlines in it ----------------------------------------
    def on_time(self, batch: Sequence[RequestRecord], now: float) -> tuple[
            list[RequestRecord], int | None]:
        """``batch`` less the least urgent rows that make its steps too slow
        for a more urgent request's deadline, and the urgency of the requests
        so protected (None: nothing dropped). A step of the batch takes
        ``o + sum of its rows' work``; a request with a deadline that can
        still meet it alone (a lost one is not protected: the others would
        lose for nothing) allows ``time left / steps left - o`` seconds of
        rows' work a step.
        Class by class, most urgent first, rows of less urgent classes go,
        least urgent first, until the step fits what the class allows."""
        cost = self.cost
        o = cost.step_overhead if cost is not None else None
        if cost is None or o is None or not batch:
            return list(batch), None
        work = {id(r): cost.work_seconds(r.request) for r in batch}
        kept = self.ordered(batch, now)
        protected = None
        for level in sorted({self.urgency(r) for r in kept})[:-1]:
            allowed = []
            for r in kept:
                deadline, steps = r.request.sampling_params.deadline_s, remaining_steps(r)
                if self.urgency(r) > level or deadline is None or steps == 0:
                    continue
                per_step = (r.arrival + deadline - now) / steps
                if per_step >= o + work[id(r)]:  # it can still make it
                    allowed.append(per_step - o)
            if not allowed:
                continue
            cap = min(allowed)
            while sum(work[id(r)] for r in kept) > cap and self.urgency(kept[-1]) > level:
                kept.pop()
                protected = level
        return kept, protected

    # -- refusal by deadline ------------------------------------------------------------
    def lateness(self, record: RequestRecord, running: Sequence[RequestRecord],
                 queued: Sequence[RequestRecord], preempting: bool,
                 now: float) -> float | None:
        """Behind the running requests it would not pause (all of them
        without preemption) and the queued ones ranked before it (those of its
        own rank came first); None without a deadline or a measured step."""
        deadline = record.request.sampling_params.deadline_s
        if deadline is None:
            return None
        mine = self.rank(record, now)[:3]
        ahead = [*(r for r in running if not preempting or self.urgency(r) <= self.urgency(record)),
                 *(r for r in queued if self.rank(r, now)[:3] <= mine)]
        finish = self.finish_estimate(record, ahead, now)
        return None if finish is None else finish - (record.arrival + deadline)

    def finish_estimate(self, record: RequestRecord, ahead: Iterable[RequestRecord],
                        now: float) -> float | None:
        """When ``record`` would finish if the requests ``ahead`` of it (the
        running ones and those ranked before it) share the engine with it:
        their own remaining work and its, plus one per-step overhead for each
        of the steps the longest of them has left (a batch pays it once a
        step). None before the model has measured a tick."""
        o = self.cost.step_overhead if self.cost is not None else None
        if o is None:
            return None
        everyone = [*ahead, record]
        work = sum(self.remaining_s(r, overhead=False) for r in everyone)
        return now + work + o * max(remaining_steps(r) for r in everyone)


__all__ = ["SloPolicy", "StepCost", "remaining_steps"]
