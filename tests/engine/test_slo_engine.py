"""The ``slo`` policy through the engine (tiny-flux, step mode): an urgent
request pauses a running one at the next step boundary and finishes first;
the paused one resumes from its kept state (bit-identical alone, within 1/255
in a batch); a sustained stream of urgent requests lets an older one through
at the aging rate; a paused request aborted frees its state; a deadline the
queue cannot meet is refused at once (``refuse_unmeetable``)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
from engine_helpers import assert_no_step_states, shared_engine
from waiting import wait_until

from diffrt.engine import (
    DeadlineUnmeetableError,
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    SamplingParams,
)
from diffrt.engine.runner_messages import CountStepStates

STEPS_PER_TICK = 2


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                          max_num_seqs=2, max_steps_per_tick=STEPS_PER_TICK, warmup=False,
                          scheduling_policy="slo", slo_aging_ticks=1000,
                          refuse_unmeetable=True, max_request_seconds=None)
    with shared_engine(DiffusionEngine.make_engine(config)) as engine:
        yield engine


class Ticks:
    """Every tick the engine's scheduler hands out: the ids it advances,
    their steps done before it, and the requests paused then (a wrapper
    around ``schedule``, removed by ``close``)."""

    def __init__(self, engine: DiffusionEngine):
        self.scheduler = scheduler = engine.scheduler
        self.log: list[tuple[list[str], dict[str, int], int, int]] = []
        #: request id -> the steps of the running requests when it was queued
        self.arrivals: dict[str, dict[str, int]] = {}
        original, add = scheduler.schedule, scheduler.add

        def queued(record) -> None:
            self.arrivals[record.request_id] = {r.request_id: r.step
                                                for r in scheduler._running}  # type: ignore[attr-defined]
            add(record)

        scheduler.add = queued  # type: ignore[method-assign]

        def schedule(now: float):
            out = original(now)
            if out is not None and out.scheduled_ids:
                steps = {rid: scheduler.record(rid).step for rid in out.scheduled_ids}  # type: ignore[union-attr]
                self.log.append((list(out.scheduled_ids), steps, scheduler.num_paused,
                                 scheduler.paused_state_bytes()))
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]

    def first_with(self, rid: str) -> tuple[list[str], dict[str, int], int, int]:
        return next(entry for entry in self.log if rid in entry[0])

    def close(self) -> None:
        del self.scheduler.schedule  # type: ignore[method-assign]
        del self.scheduler.add  # type: ignore[method-assign]


def request(rid: str, steps: int, seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest(f"a red fox {seed}", request_id=rid, sampling_params=SamplingParams(
        height=64, width=64, num_inference_steps=steps, seed=seed, **kw))


def pixels(out) -> np.ndarray:
    assert out.ok, out.error
    return np.asarray(out.images[0]).astype(np.int16)


def step_of(engine: DiffusionEngine, rid: str) -> int:
    record = engine.scheduler.record(rid)
    return -1 if record is None else record.step


def test_an_urgent_request_pauses_a_running_one_and_finishes_first(engine):
    alone = {rid: pixels(engine.generate(request(f"{rid}-solo", steps, seed)))
             for rid, steps, seed in (("low-a", 60, 1), ("low-b", 60, 2), ("high", 4, 3))}
    ticks = Ticks(engine)
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            lows = {rid: pool.submit(engine.generate, request(rid, 60, seed, priority=1))
                    for rid, seed in (("low-a", 1), ("low-b", 2))}
            assert wait_until(lambda: min(step_of(engine, r) for r in lows) >= 2)
            high = pool.submit(engine.generate, request("high", 4, 3))
            outs = {rid: f.result(timeout=120) for rid, f in (*lows.items(), ("high", high))}
    finally:
        ticks.close()
    ids, steps, paused, paused_bytes = ticks.first_with("high")
    # admitted at the first boundary after it arrived: the tick in flight, at
    # most STEPS_PER_TICK steps, is all the low ones ran meanwhile (their
    # steps as the scheduler queued it, under the core's lock)
    before = ticks.arrivals["high"]
    assert set(before) == set(lows), "the low requests had finished before it came"
    assert all(steps[rid] <= before[rid] + STEPS_PER_TICK for rid in ids if rid in before)
    assert paused == 1 and paused_bytes > 0 and len(ids) == 2  # one low paused for it
    done = {rid: out.metrics.finished_time for rid, out in outs.items()}
    assert all(done["high"] < done[rid] for rid in lows)
    assert sum(outs[rid].metrics.preemptions for rid in lows) >= 1
    for rid, out in outs.items():  # batch mates changed on the way: within 1/255
        assert np.abs(pixels(out) - alone[rid]).max() <= 1, rid
    stats = engine.stats()
    assert stats.preemptions_total >= 1
    assert (stats.requests_paused, stats.paused_state_bytes) == (0, 0)


def test_a_request_paused_and_resumed_alone_gives_its_uninterrupted_bits(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    alone = pixels(engine.generate(request("solo", 16, 7)))
    with cf.ThreadPoolExecutor(2) as pool:
        low = pool.submit(engine.generate, request("low", 16, 7, priority=1))
        assert wait_until(lambda: step_of(engine, "low") >= 2)
        high = pool.submit(engine.generate, request("high", 2, 8))
        out, urgent = low.result(timeout=120), high.result(timeout=120)
    assert out.metrics.preemptions == 1 and urgent.metrics.finished_time < out.metrics.finished_time
    assert np.array_equal(pixels(out), alone)


def test_a_sustained_urgent_stream_lets_an_older_request_through_at_the_aging_rate(
        engine, monkeypatch):
    """One seat, two urgent requests always queued: the priority-1 request
    counts as urgent after ``aging`` ticks of waiting and, once running, is
    not paused by a request of its (aged) class, so it finishes while the
    stream goes on."""
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    monkeypatch.setattr(engine.scheduler.policy, "aging_ticks", 2)
    with cf.ThreadPoolExecutor(3) as pool:
        stream = [pool.submit(engine.generate, request(f"urgent-{i}", 2, 100 + i))
                  for i in range(2)]
        low = pool.submit(engine.generate, request("old", 6, 9, priority=1))
        submitted = 2
        while not low.done() and submitted < 40:  # keep two urgent ones queued
            done, _ = cf.wait([f for f in stream if not f.done()] or stream,
                              return_when=cf.FIRST_COMPLETED, timeout=60)
            stream += [pool.submit(engine.generate, request(f"urgent-{submitted}", 2,
                                                            100 + submitted))]
            submitted += 1
        out = low.result(timeout=120)
        urgent = [f.result(timeout=120) for f in stream]
    assert out.ok and submitted < 40, "the priority-1 request starved"
    after = [u for u in urgent if u.metrics.finished_time > out.metrics.finished_time]
    assert after, "it ran only once the stream had ended"


def count(engine: DiffusionEngine) -> int:
    return engine.executor.collective_rpc(CountStepStates())[0].count


def test_aborting_a_paused_request_frees_its_state(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)
    with cf.ThreadPoolExecutor(2) as pool:
        low = pool.submit(engine.generate, request("paused", 200, 11, priority=1))
        assert wait_until(lambda: step_of(engine, "paused") >= 1)
        high = pool.submit(engine.generate, request("runs", 120, 12))
        assert wait_until(lambda: engine.scheduler.num_paused == 1)
        assert engine.stats().paused_state_bytes > 0
        engine.abort("paused")
        assert low.result(timeout=60).aborted
        # dropped in the worker at the next tick, while the other one runs on
        assert wait_until(lambda: count(engine) <= 1)
        assert not high.done()
        assert high.result(timeout=120).ok
    assert engine.scheduler.num_paused == 0 and engine.stats().paused_state_bytes == 0
    assert_no_step_states(engine)


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(engine):
    """Refused for the queue, not for itself: the same request is accepted
    alone, and a more urgent one with the same deadline is accepted behind
    the same queue (it would pause the long request)."""
    engine.generate(request("measure", 20, 13))  # measured ticks: the step-time model
    solo = engine.generate(request("solo", 20, 13)).metrics
    deadline = 3 * (solo.finished_time - solo.arrival_time) + 0.2
    refused = engine.stats().requests_deadline_total.get(("0", "refused"), 0)
    with cf.ThreadPoolExecutor(1) as pool:
        long = pool.submit(engine.generate, request("long", 1000, 14))
        assert wait_until(lambda: step_of(engine, "long") >= 1)
        with pytest.raises(DeadlineUnmeetableError, match="deadline_s") as info:
            engine.generate(request("behind", 20, 15, deadline_s=deadline))
        assert info.value.retry_after_s >= 1
        urgent = engine.generate(request("urgent", 20, 15, deadline_s=deadline, priority=-1))
        assert urgent.ok and urgent.metrics.preemptions == 0
        engine.abort("long")
        assert long.result(timeout=60).aborted
    alone = engine.generate(request("alone", 20, 15, deadline_s=max(deadline, 600.0)))
    assert alone.ok and alone.metrics.deadline_met is True
    stats = engine.stats()
    assert stats.requests_deadline_total.get(("0", "met"), 0) >= 1
    assert stats.requests_deadline_total.get(("0", "refused"), 0) == refused + 1
