"""Whether rows of different kinds share a step: decided by the step-cost model.

With ``mixed_size_batching`` requests of different sizes, adapters or step
caches *may* share a denoise step; whether they *should* depends on what a
shared step costs on this machine. A shared step of a batch ``B`` and a
candidate ``c`` of another kind (its ``kind`` key differs from every row of
the batch's: another size, say) costs ``S``; apart, a step of ``B`` costs
``A`` and one of ``c`` costs ``C``, plus a tick's fixed cost ``t`` each
(the step-cost model's ``step_seconds`` and ``tick_seconds``). Apart, ``c``
runs after ``B`` drains (the keyed engine's order); shared, every request
of both advances at ``S`` a step while both run. ``c`` joins only when
sharing

- gives a lower sum of the requests' completion times than apart, by
  ``MARGIN`` of it (so the model's noise does not decide: mixing must never
  be the cause of a worse latency), and
- pushes no request of ``B`` that would meet its deadline apart past it,
  and
- makes no request finish later (by more than ``MARGIN``) than apart when
  it ranks above another of the step (``urgency``, smaller first: the
  ``slo`` policy's priority classes): rows of a lower class may not slow a
  higher one's steps. Apart, a candidate more urgent than every row of
  ``B`` runs first where the scheduler preempts (``B`` is paused for it,
  ``preempting``) and after ``B`` drains otherwise. So a one-frame image
  request (priority 0) does not share the steps of running clips (priority
  5): they are paused at the step boundary and it runs alone; nor does a
  paused clip rejoin before the image is done.

By ``by_size`` (a call per size, the CPU's arrangement) ``S`` is about
``A + C``: sharing saves only a tick's fixed cost and makes the small rows
wait for the large ones' calls, so between requests of about equal length
it stays off. A request far shorter than the batch's would gain by joining
(apart it waits for the whole batch to drain), but only by slowing every
row of the batch: a reorder, not a saving. Measured on the 2-core CPU
(``bench_mixed_traffic.py``), sharing on that gain alone made the p99 1.38x
the keyed engine's (1.81x under the same ``skip_ahead`` policy). So by
``by_size`` (``protect_batch``) no row of the batch may finish later, by
more than ``MARGIN``, than apart. With one call over all rows (``padded``,
``packed``) and a large per-call cost (launches), ``S`` is well under
``A + C``: the sum decides, and sharing turns on. A request refused is
passed by at most ``max_bypass`` admission rounds of the running kind, then
waits only for the running batch to drain (no starvation). Every decision is
kept (``log``) for ``diffrt bench --explain``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from diffrt.engine.record import RequestRecord
from diffrt.engine.request import DiffusionRequest

#: the share of the apart plan's summed completion times sharing must save
MARGIN = 0.05
#: decisions kept for ``--explain``
LOG_SIZE = 1000


class ShareCost(Protocol):
    """What the decision needs of the step-cost model (``RunTimeModel``)."""

    def step_seconds(self, requests: Sequence[DiffusionRequest]) -> float | None: ...

    @property
    def tick_seconds(self) -> float | None: ...


@dataclass(frozen=True)
class Decision:
    """One share/split decision and the figures it came from."""

    candidate: str
    batch: tuple[str, ...]
    shared: bool
    reason: str
    shared_step_s: float = 0.0
    batch_step_s: float = 0.0
    alone_step_s: float = 0.0

    def explain(self) -> str:
        verdict = "shared" if self.shared else "split"
        return (f"{self.candidate} with [{', '.join(self.batch)}]: {verdict} ({self.reason}; "
                f"step together {self.shared_step_s * 1e3:.2f} ms, apart "
                f"{self.batch_step_s * 1e3:.2f} + {self.alone_step_s * 1e3:.2f} ms)")


def _left(record: RequestRecord) -> int:
    return max(1, record.total_steps - record.step)


class ShareDecider:
    """Decides, per candidate, whether it shares the batch's steps (see the module)."""

    def __init__(self, cost: ShareCost, kind: Callable[[DiffusionRequest], tuple], *,
                 max_bypass: int = 4, margin: float = MARGIN,
                 urgency: Callable[[RequestRecord], int] | None = None,
                 protect_batch: bool = False):
        self.cost = cost
        self.kind = kind
        #: no row of the batch may finish later than apart (``by_size``: a
        #: shared step saves nothing, so sharing only reorders; see the module)
        self.protect_batch = protect_batch
        #: the policy's classes (smaller: more urgent); None: all alike
        self.urgency = urgency or (lambda record: 0)
        self.max_bypass = max_bypass
        self.margin = margin
        self.log: deque[Decision] = deque(maxlen=LOG_SIZE)
        self.shared = 0
        self.split = 0

    def same_kind(self, record: RequestRecord, batch: Sequence[RequestRecord]) -> bool:
        kind = self.kind(record.request)
        return any(self.kind(r.request) == kind for r in batch)

    def decide(self, batch: Sequence[RequestRecord], candidate: RequestRecord, now: float,
               *, preempting: bool = False, log: bool = True) -> Decision:
        """Whether ``candidate`` (of a kind none of ``batch`` is) shares its
        steps; ``preempting``: the scheduler would pause ``batch`` for a
        candidate more urgent than all of it; ``log=False``: a look ahead
        (preemption's), not kept for ``--explain``."""
        note = self._note if log else (lambda decision: decision)
        ids = tuple(r.request_id for r in batch)
        requests = [r.request for r in batch]
        s = self.cost.step_seconds([*requests, candidate.request])
        a = self.cost.step_seconds(requests)
        c = self.cost.step_seconds([candidate.request])
        t = self.cost.tick_seconds or 0.0
        if s is None or a is None or c is None:
            return note(Decision(candidate.request_id, ids, False,
                                 "no step-cost model yet: apart"))
        a, c, s = a + t, c + t, s + t
        urgency = self.urgency
        mine = urgency(candidate)
        n, longest = _left(candidate), max(_left(r) for r in batch)
        first = preempting and all(mine < urgency(r) for r in batch)
        # apart: the candidate runs alone first (the batch paused for it) or after the batch
        mine_apart = n * c if first else longest * a + n * c
        mine_together = min(n, longest) * s + max(0, n - longest) * c
        behind = n * c if first else 0.0  # what the batch waits apart
        slower = 1.0 + self.margin
        apart, together = mine_apart, mine_together
        for record in batch:
            m = _left(record)
            finish_apart = behind + m * a
            finish = min(m, n) * s + max(0, m - n) * a
            apart += finish_apart
            together += finish
            deadline = record.request.sampling_params.deadline_s
            if deadline is not None:
                due = record.arrival + deadline
                if now + finish_apart <= due < now + finish:
                    return note(Decision(candidate.request_id, ids, False,
                                         f"{record.request_id} would miss its deadline", s, a, c))
            if finish > slower * finish_apart and (self.protect_batch or urgency(record) < mine):
                why = ("ranks above it and would finish later" if urgency(record) < mine
                       else "would finish later (a call per size saves nothing)")
                return note(Decision(candidate.request_id, ids, False,
                                     f"{record.request_id} {why}", s, a, c))
        if any(mine < urgency(r) for r in batch) and mine_together > slower * mine_apart:
            return note(Decision(candidate.request_id, ids, False,
                                 "it ranks above the batch and would finish later", s, a, c))
        shared = together < (1.0 - self.margin) * apart
        reason = (f"summed completion {together:.3g} s together vs {apart:.3g} s apart"
                  if math.isfinite(together) else "no estimate")
        return note(Decision(candidate.request_id, ids, shared, reason, s, a, c))

    def _note(self, decision: Decision) -> Decision:
        self.log.append(decision)
        if decision.shared:
            self.shared += 1
        else:
            self.split += 1
        return decision


__all__ = ["Decision", "MARGIN", "ShareCost", "ShareDecider"]
