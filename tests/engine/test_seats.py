"""Seats among the waiting (``engine/seats.py``): what a server's max_pending
counts. A seat counts as waiting from the moment it is taken, moves into the
queue with its request (never counted twice), ends at admission (told once,
on the engine loop), and a seat whose request never arrived is given back;
releasing twice, or after the queue took over, changes nothing."""

from __future__ import annotations

import asyncio
import threading

import engine_toy
import pytest
from engine_helpers import toy_request
from waiting import wait_for


def test_a_seat_is_waiting_until_its_request_is_admitted(step_engine1, req_engine1):
    for engine in (step_engine1, req_engine1):
        _seat_until_admission(engine)


def _seat_until_admission(engine) -> None:
    admitted: list[str] = []
    gate = engine_toy.gate("seats")
    gate.clear()

    def waiting() -> int:
        return engine.stats().requests_waiting

    async def main():
        blocker = asyncio.ensure_future(engine.generate_async(toy_request("block:seats")))
        await wait_for(lambda: engine.stats().requests_running == 1)
        seat = engine.take_seat(2, on_admitted=lambda: admitted.append(
            threading.current_thread().name))
        spare = engine.take_seat(2)
        refused = engine.take_seat(2)
        assert seat.taken and spare.taken and not refused.taken
        assert refused.waiting == 2 and waiting() == 2  # seats count before any submission
        spare.release()
        spare.release()  # once or twice: given back once
        refused.release()
        assert waiting() == 1
        outputs = engine.step_streaming(toy_request("p"), seat=seat)
        final = asyncio.ensure_future(_last(outputs))
        await wait_for(lambda: engine.scheduler.num_waiting == 1)
        assert waiting() == 1  # moved into the queue, not counted twice
        seat.release()  # the queue holds it now: a no-op
        assert waiting() == 1 and not admitted
        gate.set()
        out = await final
        await blocker
        return out

    out = asyncio.run(main())
    assert out.ok
    assert admitted == ["diffrt-engine-loop"]  # told once, on the loop's thread
    assert waiting() == 0


async def _last(outputs):
    final = None
    async for out in outputs:
        final = out
    return final


def test_a_seat_whose_request_is_refused_at_submission_is_the_callers(step_engine1):
    from diffrt.engine import InvalidRequestError

    seat = step_engine1.take_seat(4)

    async def main():
        with pytest.raises(InvalidRequestError):
            async for _ in step_engine1.step_streaming(toy_request("p", size=12), seat=seat):
                pass

    asyncio.run(main())
    assert step_engine1.stats().requests_waiting == 1  # not submitted: still held
    seat.release()
    assert step_engine1.stats().requests_waiting == 0


def test_a_refused_seat_carries_the_predicted_time_to_the_next_admission(step_engine1,
                                                                       monkeypatch):
    """What a server sheds with (Retry-After): the running request's steps
    left at the step-cost model's momentary step time (a step plus its
    share of a tick's fixed cost); without a prediction, None."""
    from diffrt.engine.run_time import RunTimeModel

    engine = step_engine1
    model = engine._core._run_time
    monkeypatch.setattr(model, "step_seconds", lambda requests, **kw: 0.2 * len(requests))
    monkeypatch.setattr(RunTimeModel, "tick_seconds", property(lambda self: 0.05))
    gate = engine_toy.gate("retry")
    gate.clear()

    async def main():
        blocker = asyncio.ensure_future(engine.generate_async(toy_request("block:retry",
                                                                          steps=9)))
        await wait_for(lambda: engine.stats().requests_running == 1)
        refused = engine.take_seat(0)
        step = engine.scheduler.record(engine.scheduler._running[0].request_id).step
        monkeypatch.setattr(model, "step_seconds", lambda requests, **kw: None)
        unknown = engine.take_seat(0)
        gate.set()
        await blocker
        return refused, step, unknown

    refused, step, unknown = asyncio.run(main())
    assert not refused.taken and refused.retry_after_s == pytest.approx((9 - step) * 0.25)
    assert not unknown.taken and unknown.retry_after_s is None


def test_the_next_admission_is_the_soonest_end_in_step_mode_and_the_waves_end_in_request_mode():
    from sched_helpers import req

    from diffrt.engine.record import RequestRecord
    from diffrt.engine.sched import RequestScheduler, StepScheduler

    def per_step(requests):
        return 0.5

    step = StepScheduler(4)
    assert step.next_admission_s(0.0, per_step) is None  # nothing runs: no wait to predict
    for rid, steps in (("a", 3), ("b", 7)):
        step.add(RequestRecord(req(rid, steps=steps), arrival=0.0))
    step.schedule(now=0.0)
    assert step.next_admission_s(0.0, per_step) == 1.5
    assert step.next_admission_s(0.0, lambda requests: None) is None
    wave = RequestScheduler(4)  # a wave's requests run the same steps (its key)
    for rid in ("a", "b"):
        wave.add(RequestRecord(req(rid, steps=7), arrival=0.0))
    wave.schedule(now=10.0)
    assert wave.next_admission_s(11.0, per_step) == 2.5  # 7 steps of 0.5 s, 1 s of them run
