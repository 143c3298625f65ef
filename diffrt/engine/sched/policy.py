"""Admission policies: which waiting requests join the next batch.

Both policies only admit requests whose compatibility key equals the batch's
key (the running batch's, or the oldest waiting request's for a new batch).
They differ in what an incompatible request in the queue does:

* ``fifo`` (strict arrival order): admission stops at the first incompatible
  request, so it blocks every younger request behind it (head-of-line
  blocking), even ones that could have joined.
* ``slo`` (``slo.py``): by priority, then least slack to the deadline, with
  aging; in STEP_BATCH the scheduler also pauses running requests for more
  urgent ones (``preempts``).
* ``skip_ahead``: younger compatible requests may be admitted past an
  incompatible one. Each time that happens the skipped request's ``bypassed``
  count grows; once it reaches ``max_bypass`` the request blocks admission like
  a FIFO head, the running batch drains, and it starts the next batch. No
  request can therefore be overtaken more than ``max_bypass`` times (aging).
"""

from __future__ import annotations

import typing
from abc import ABC, abstractmethod
from collections.abc import Sequence

from diffrt.engine.record import RequestRecord
from diffrt.engine.settings import Policy

POLICIES: tuple[str, ...] = typing.get_args(Policy)  # declared once, with the setting


class AdmissionPolicy(ABC):
    name: str
    #: the step scheduler may pause running requests for waiting ones that
    #: this policy ranks more urgent (``urgency``)
    preempts: bool = False

    @abstractmethod
    def select(
        self, waiting: Sequence[RequestRecord], key: tuple | None, capacity: int,
        now: float = 0.0,
    ) -> list[RequestRecord]:
        """Pick up to ``capacity`` requests of ``waiting`` (arrival order) that may
        join a batch of ``key`` (None: a new batch, keyed by the first request
        the policy takes), in the order they are to be admitted."""

    def waited(self, records: Sequence[RequestRecord], now: float) -> None:
        """A scheduler tick passed at ``now`` and ``records`` still wait (aging)."""
        return None

    def urgency(self, record: RequestRecord) -> int:
        """Preemption's measure (smaller: more urgent; a running request is
        paused only for a strictly more urgent one): all alike here."""
        return 0

    def ordered(self, records: Sequence[RequestRecord], now: float) -> list[RequestRecord]:
        """``records``, in the order this policy would admit them."""
        return list(records)

    def on_time(self, batch: Sequence[RequestRecord], now: float) -> tuple[
            list[RequestRecord], int | None]:
        """The rows of ``batch`` to keep for its deadlines, and the urgency
        they were kept for (None: all kept)."""
        return list(batch), None

    def lateness(self, record: RequestRecord, running: Sequence[RequestRecord],
                 queued: Sequence[RequestRecord], preempting: bool,
                 now: float) -> float | None:
        """Seconds past its deadline ``record`` would finish if queued at
        ``now`` beside ``running`` and ``queued`` (waiting or paused) requests
        (<= 0: in time); None where this policy cannot tell."""
        return None


class SkipAheadPolicy(AdmissionPolicy):
    name = "skip_ahead"

    def __init__(self, max_bypass: int = 4):
        if max_bypass < 0:
            raise ValueError(f"max_bypass must be >= 0, got {max_bypass}")
        self.max_bypass = max_bypass

    def select(self, waiting: Sequence[RequestRecord], key: tuple | None,
               capacity: int, now: float = 0.0) -> list[RequestRecord]:
        if capacity <= 0 or not waiting:
            return []
        if key is None:
            key = waiting[0].key
        chosen: list[RequestRecord] = []
        skipped: list[RequestRecord] = []
        for record in waiting:
            if len(chosen) >= capacity:
                break
            if record.key == key:
                chosen.append(record)
                for older in skipped:
                    older.bypassed += 1
                skipped.clear()  # each is counted once per admission round
                continue
            if record.bypassed >= self.max_bypass:
                break  # aged: it blocks like a FIFO head until the batch drains
            skipped.append(record)
        return chosen


class FifoPolicy(SkipAheadPolicy):
    """Arrival order, the head of the queue blocking: skip-ahead that lets no
    request pass another (a request of another batch key ends the batch)."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__(max_bypass=0)

