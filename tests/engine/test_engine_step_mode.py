"""STEP_BATCH through the engine: progress streams, joins, aborts, cancellation."""

from __future__ import annotations

import asyncio
import threading

import engine_toy as toy
import numpy as np
from engine_helpers import assert_clean, toy_engine, toy_request, wait_until
from waiting import wait_for

from diffrt.engine.runner_messages import CountStepStates, StepStateCount


def first_pixel(out) -> int:
    return int(np.asarray(out.images[0])[0, 0, 0])


async def collect(engine, request) -> list:
    return [o async for o in engine.step_streaming(request)]


def steps_of(request) -> int:
    """How many denoise steps of ``request`` the toy pipeline has entered (a
    "block:" request waits at its gate inside the step it entered last)."""
    return sum(request.request_id in ids for ids in toy.calls("step"))


def test_streaming_yields_progress_then_final(step_engine1):
    r = toy_request(seed=5, steps=4)
    outs = asyncio.run(collect(step_engine1, r))
    assert [(o.step, o.total_steps, o.finished) for o in outs] == [
        (1, 4, False), (2, 4, False), (3, 4, False), (4, 4, True)]
    assert outs[-1].ok and first_pixel(outs[-1]) == toy.expected_pixel(5, 4)
    assert outs[-1].metrics.forward_time > 0
    assert_clean(step_engine1)


def test_generate_consumes_the_same_stream(step_engine1):
    outs = step_engine1.generate([toy_request(seed=i, steps=1 + i) for i in range(3)])
    assert [first_pixel(o) for o in outs] == [toy.expected_pixel(i, 1 + i) for i in range(3)]


def test_serial_step_engine_never_batches(step_engine1):
    toy.reset()
    reqs = [toy_request(steps=2) for _ in range(3)]
    step_engine1.generate(reqs)
    assert all(len(ids) == 1 for ids in toy.calls("step"))
    assert len(toy.calls("step")) == 6


def test_different_step_counts_share_step_batches(step_engine4):
    toy.reset()
    short, long_ = toy_request(seed=1, steps=2), toy_request(seed=2, steps=5)
    outs = step_engine4.generate([short, long_])
    assert first_pixel(outs[0]) == toy.expected_pixel(1, 2)
    assert first_pixel(outs[1]) == toy.expected_pixel(2, 5)
    s, lg = short.request_id, long_.request_id
    assert toy.calls("step") == [[s, lg], [s, lg], [lg], [lg], [lg]]


def join_while_blocked(engine, first_steps: int) -> tuple[str, str]:
    """A request blocked inside its first step, a second one arriving meanwhile;
    both run to their end. Returns their ids."""
    toy.reset()
    toy.gate("join").clear()
    first = toy_request("block:join", steps=first_steps)
    got: list = []
    t1 = threading.Thread(target=lambda: got.append(engine.generate(first)))
    t1.start()
    assert wait_until(lambda: toy.calls("step"))
    later = toy_request(steps=2)
    t2 = threading.Thread(target=lambda: got.append(engine.generate(later)))
    t2.start()
    assert wait_until(lambda: engine.scheduler.num_waiting == 1)
    toy.gate("join").set()
    t1.join(10)
    t2.join(10)
    assert len(got) == 2 and all(o.ok for o in got)
    return first.request_id, later.request_id


def test_a_request_joins_a_running_batch_at_a_step_boundary(step_engine4):
    f, lt = join_while_blocked(step_engine4, first_steps=3)
    assert toy.calls("step") == [[f], [f, lt], [f, lt]]


def test_requests_finishing_together_are_decoded_together(step_engine4):
    toy.reset()
    reqs = [toy_request(seed=i, steps=2) for i in range(3)] + [toy_request(seed=9, steps=3)]
    outs = step_engine4.generate(reqs)
    assert [first_pixel(o) for o in outs] == [toy.expected_pixel(i, 2) for i in range(3)] + [
        toy.expected_pixel(9, 3)]
    ids = [r.request_id for r in reqs]
    assert toy.calls("decode") == [ids[:3], ids[3:]]


def test_decode_failure_is_mapped_to_its_request(step_engine4):
    reqs = [toy_request(seed=1), toy_request("faildecode"), toy_request(seed=2)]
    outs = step_engine4.generate(reqs)
    assert outs[0].ok and outs[2].ok and not outs[1].ok
    assert "toy decode failure" in outs[1].error
    assert first_pixel(outs[2]) == toy.expected_pixel(2, 2)


def test_error_in_a_step_batch_fails_only_its_request(step_engine4):
    reqs = [toy_request(seed=1, steps=3), toy_request("failstep", steps=3),
            toy_request("fail", steps=3), toy_request(seed=2, steps=3)]
    outs = step_engine4.generate(reqs)
    assert outs[0].ok and outs[3].ok
    assert first_pixel(outs[3]) == toy.expected_pixel(2, 3)
    assert "toy step failure" in outs[1].error
    assert "prepare_encode" in outs[2].error
    assert step_engine4.is_healthy()
    assert_clean(step_engine4)
    assert step_engine4.executor.collective_rpc(CountStepStates()) == [StepStateCount(0)]


def test_abort_running_request_at_next_step_boundary(step_engine4):
    toy.reset()
    toy.gate("sa").clear()
    victim = toy_request("block:sa", steps=50)
    other = toy_request(steps=3)
    got: dict = {}

    def run(r):
        got[r.request_id] = step_engine4.generate(r)

    threads = [threading.Thread(target=run, args=(r,)) for r in (victim, other)]
    for t in threads:
        t.start()
    assert wait_until(lambda: step_engine4.num_active_requests() == 2 and toy.calls("step"))
    step_engine4.abort(victim.request_id)  # in flight: takes effect at the boundary
    toy.gate("sa").set()
    for t in threads:
        t.join(10)
    assert got[victim.request_id].aborted
    assert got[victim.request_id].step < 50
    assert got[other.request_id].ok
    assert_clean(step_engine4)
    # The worker dropped the aborted request's step state.
    assert wait_until(lambda: step_engine4.executor.collective_rpc(CountStepStates()) == [StepStateCount(0)])


def test_cancelled_consumer_removes_only_its_stream(step_engine4):
    toy.gate("cc").clear()
    r = toy_request("block:cc", steps=3)

    async def consume_one_then_leave():
        agen = step_engine4.step_streaming(r)
        first = await agen.__anext__()
        await agen.aclose()
        return first

    async def main():
        task = asyncio.create_task(consume_one_then_leave())
        await wait_for(lambda: steps_of(r) == 1)  # admitted, blocked in its first step
        toy.gate("cc").set()
        return await task

    first = asyncio.run(main())
    assert first.step == 1 and not first.finished
    # The request is still run to its end (all 3 steps, not aborted) and cleaned up.
    assert_clean(step_engine4)
    assert steps_of(r) == 3


def test_consumer_cancelled_while_waiting(step_engine1):
    toy.gate("cw").clear()
    r = toy_request("block:cw", steps=2)

    async def main():
        task = asyncio.create_task(collect(step_engine1, r))
        # The consumer waits on its open stream; the request is blocked in its first step.
        await wait_for(lambda: steps_of(r) == 1 and step_engine1.output_processor.num_streams() == 1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(main())
    assert step_engine1.output_processor.num_streams() == 0
    assert step_engine1.num_active_requests() == 1  # still running: only the queue left
    toy.gate("cw").set()
    assert_clean(step_engine1)
    assert steps_of(r) == 2  # ran to its end


def test_close_with_open_async_streams():
    engine = toy_engine(max_num_seqs=2, step_execution=True)
    toy.gate("sc").clear()

    async def main():
        reqs = [toy_request("block:sc", steps=3) for _ in range(3)]
        tasks = [asyncio.create_task(collect(engine, r)) for r in reqs]
        # All three streams are open and the first step batch (two of them) is stuck.
        await wait_for(lambda: engine.num_active_requests() == 3 and sum(map(steps_of, reqs)) == 2)
        closing = asyncio.get_running_loop().run_in_executor(None, engine.close)
        # Every stream hears while the forward is still stuck in the worker.
        results = await asyncio.gather(*tasks)
        toy.gate("sc").set()
        await closing
        return results

    try:
        results = asyncio.run(main())
    finally:
        toy.gate("sc").set()
        engine.close()  # idempotent; frees the engine if main() failed early
    for outs in results:
        assert outs[-1].finished and outs[-1].error == "engine closed"


def test_dozens_of_concurrent_streams_lose_or_swap_nothing(step_engine4):
    n = 48
    reqs = [toy_request(seed=i, steps=1 + i % 4, num_outputs_per_prompt=1 + i % 2)
            for i in range(n)]

    async def main():
        return await asyncio.gather(*(collect(step_engine4, r) for r in reqs))

    results = asyncio.run(main())
    for i, (r, outs) in enumerate(zip(reqs, results, strict=True)):
        assert all(o.request_id == r.request_id for o in outs)
        final = outs[-1]
        assert final.ok and [o.finished for o in outs].count(True) == 1
        assert [o.step for o in outs[:-1]] == list(range(1, 1 + i % 4))
        assert len(final.images) == 1 + i % 2
        assert first_pixel(final) == toy.expected_pixel(i, 1 + i % 4)
    assert_clean(step_engine4)


def test_dozens_of_threads_on_a_request_engine(req_engine4):
    n = 40
    reqs = [toy_request(seed=i, steps=1 + i % 3) for i in range(n)]
    results: dict = {}

    def run(r):
        results[r.request_id] = req_engine4.generate(r)

    threads = [threading.Thread(target=run, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, r in enumerate(reqs):
        assert first_pixel(results[r.request_id]) == toy.expected_pixel(i, 1 + i % 3)
    assert_clean(req_engine4)


# -- several steps per worker call --------------------------------------------------
def _count_calls(engine, monkeypatch) -> list:
    """The ExecuteStep messages the engine sends (one per worker round trip)."""
    sent: list = []
    real = engine.executor.execute

    def execute(request, *args, **kw):
        sent.append(request)
        return real(request, *args, **kw)

    monkeypatch.setattr(engine.executor, "execute", execute)
    return sent


def test_a_lone_batch_runs_several_steps_per_call_with_every_progress(monkeypatch):
    """Nothing waiting: the worker runs up to max_steps_per_tick steps per call
    (never past a request's end); every step still yields its progress item."""
    engine = toy_engine(max_num_seqs=4, step_execution=True, max_steps_per_tick=3,
                        step_batch_max_wait_ms=0)
    try:
        toy.reset()
        sent = _count_calls(engine, monkeypatch)
        short, long_ = toy_request(seed=1, steps=2), toy_request(seed=2, steps=7)
        got = engine.generate([short, long_])
        assert [first_pixel(o) for o in got] == [toy.expected_pixel(1, 2),
                                                toy.expected_pixel(2, 7)]
        s, lg = short.request_id, long_.request_id
        # one denoise call per step, as with single-step ticks ...
        assert toy.calls("step") == [[s, lg], [s, lg]] + [[lg]] * 5
        # ... in 3 round trips: 2 steps (the short one ends), then 3, then 2
        assert [m.steps for m in sent] == [2, 3, 2]
        r = toy_request(seed=5, steps=7)
        stream = asyncio.run(collect(engine, r))
        assert [o.step for o in stream] == [1, 2, 3, 4, 5, 6, 7]
        assert stream[-1].finished and first_pixel(stream[-1]) == toy.expected_pixel(5, 7)
    finally:
        engine.close()


def test_a_waiting_request_turns_multi_step_calls_back_to_single_steps(monkeypatch):
    """A request waiting to join makes the next call one step long, so it joins
    at the next boundary; it waited at most one multi-step call."""
    engine = toy_engine(max_num_seqs=4, step_execution=True, max_steps_per_tick=4,
                        step_batch_max_wait_ms=0)
    try:
        sent = _count_calls(engine, monkeypatch)
        f, lt = join_while_blocked(engine, first_steps=8)
        assert sent[0].steps == 4 and sent[1].new[0].request_id == lt
        assert toy.calls("step")[:6] == [[f]] * 4 + [[f, lt]] * 2
    finally:
        engine.close()
