"""Seats among the waiting requests: how a server bounds them without a race.

A server sheds a request (``diffrt serve --max-pending``: 429) when enough
requests already wait to be admitted. Reading the scheduler's waiting queue
is not enough: a server accepts a request before it submits it (an asyncio
server submits on the first item of the output stream, a turn of the event
loop later), so every request of a burst passes a check of the queue before
any of them is in it.

A ``Seat`` is one accepted request's place. ``DiffusionEngine.take_seat``
takes it under the engine core's lock, counting the seats whose request has
not reached the scheduler yet plus the scheduler's waiting queue, and
refuses one once ``limit`` wait. Submitting the request with its seat
(``step_streaming(request, seat=seat)``) moves it into the queue under the
same lock, so the count never skips nor doubles it; from then on the queue
holds the request's place until it is admitted to the running set (also
through a worker restart, which keeps waiting requests queued). So the
waiting count (``stats().requests_waiting``, which includes the seats) never
exceeds ``limit`` through seats, whatever the arrival pattern.

``release`` gives back a seat whose request never reached the queue (refused
at submission, its client gone first, the engine down); once the request is
queued it does nothing (the queue's own bookkeeping ends the place: at
admission, or when the request ends before it). So every path of a server may
call it, once or several times: a seat is counted exactly once.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

logger = logging.getLogger(__name__)


class SeatState(enum.Enum):
    #: refused: ``limit`` requests were waiting
    REFUSED = "refused"
    #: taken; its request has not reached the scheduler (counted by the core)
    HELD = "held"
    #: its request is in the scheduler's waiting queue (counted there)
    QUEUED = "queued"
    #: admitted to the running set
    ADMITTED = "admitted"
    #: given back before its request reached the queue
    RELEASED = "released"


class Seat:
    """One accepted request's place among the waiting; see the module docstring.

    ``state`` is written under the engine core's lock only (``EngineCore``
    owns the count); ``waiting`` is the count the seat was taken or refused
    at, for the message a server sheds with.
    """

    def __init__(self, waiting: int, give_back: Callable[[Seat], None] | None = None,
                 on_admitted: Callable[[], None] | None = None):
        self.waiting = waiting
        #: refused: the predicted seconds until a waiting request is next
        #: admitted (the engine's step-cost model), None without a prediction
        self.retry_after_s: float | None = None
        self.state = SeatState.HELD if give_back is not None else SeatState.REFUSED
        self._give_back = give_back
        #: called once, on the engine loop's thread with no lock held, when the
        #: request joins the running set (a Ray replica tells its ingress)
        self._on_admitted = on_admitted

    @property
    def taken(self) -> bool:
        """False when the seat was refused (the server sheds the request)."""
        return self.state is not SeatState.REFUSED

    def release(self) -> None:
        """Give the seat back if its request never reached the queue; else
        nothing. Idempotent, from any thread."""
        if self._give_back is not None:
            self._give_back(self)

    def admitted(self) -> None:
        """The engine admitted the request (called by the core, once)."""
        if self._on_admitted is None:
            return
        try:
            self._on_admitted()
        except Exception:  # a listener's bug must not stop the engine loop
            logger.exception("a seat's admission callback failed")


class Seated(Protocol):
    """What the seat count reads of a request's record (``RequestRecord``)."""

    seat: Seat | None
    aborted: bool


class Seats:
    """The count of seats taken whose request has not reached the scheduler,
    kept under the engine core's lock (``lock``): ``take`` and ``give_back``
    take it, the others run with it held already."""

    def __init__(self, lock: threading.Condition):
        self._lock = lock
        #: seats taken whose request has not reached the scheduler (under the lock)
        self.held = 0
        #: seats of the requests the last schedule admitted (the loop's thread only)
        self._admitted: list[Seat] = []

    def take(self, limit: int, queued: Callable[[], int],
             on_admitted: Callable[[], None] | None = None) -> Seat:
        """A seat, or a refused one when ``limit`` requests wait already (the
        seats not yet queued plus the ``queued()`` ones)."""
        with self._lock:
            waiting = self.held + queued()
            if waiting >= limit:
                return Seat(waiting)
            self.held += 1
            return Seat(waiting, self._give_back, on_admitted)

    def _give_back(self, seat: Seat) -> None:
        with self._lock:
            if seat.state is SeatState.HELD:
                self.held -= 1
                seat.state = SeatState.RELEASED

    def queue(self, record: Seated) -> None:
        """Under the lock: ``record`` reached the scheduler (or ended first,
        an abort racing its submission); the queue counts it from now on."""
        seat = record.seat
        if seat is not None and seat.state is SeatState.HELD:
            self.held -= 1
            seat.state = SeatState.QUEUED if not record.aborted else SeatState.RELEASED

    def note_admitted(self, records: Iterable[Seated | None]) -> None:
        """Under the lock: the seats of the records a tick admits, told by
        ``tell_admitted`` once the lock is released."""
        for record in records:
            seat = record.seat if record is not None else None
            if seat is not None and seat.state is SeatState.QUEUED:
                seat.state = SeatState.ADMITTED
                self._admitted.append(seat)

    def tell_admitted(self) -> None:
        """On the loop's thread, no lock held: call the admitted seats' listeners."""
        admitted, self._admitted = self._admitted, []
        for seat in admitted:
            seat.admitted()


__all__ = ["Seat", "SeatState", "Seats"]
