"""One request can never hurt another: refusals at submission, bounded unread
outputs, admission limits and timeouts, outputs that name their seed."""

from __future__ import annotations

import asyncio

import engine_toy as toy
import numpy as np
import pytest
from engine_helpers import assert_clean, toy_engine, toy_request
from waiting import wait_for, wait_until

from diffrt.engine import DiffusionOutput, DiffusionRequest, InvalidRequestError, SamplingParams
from diffrt.engine.request import MAX_PROMPT_BYTES, MAX_REQUEST_ID_CHARS
from diffrt.engine.submission import timeout_of


def pixels(out: DiffusionOutput) -> set[int]:
    return {int(v) for img in out.images for v in np.unique(np.asarray(img))}


POISON = [
    ("seed", dict(sampling_params=SamplingParams(height=16, width=16, seed=2**64))),
    ("seed", dict(sampling_params=SamplingParams(height=16, width=16, seed=-(2**63) - 1))),
    ("seed", dict(sampling_params=SamplingParams(height=16, width=16, seed=True))),
    ("prompt", dict(prompt="a \ud800 fox")),
    ("negative_prompt", dict(negative_prompt="\udfff")),
    ("prompt", dict(prompt="x" * (MAX_PROMPT_BYTES + 1))),
    ("request_id", dict(request_id=7)),
    ("request_id", dict(request_id="")),
    ("request_id", dict(request_id="r" * (MAX_REQUEST_ID_CHARS + 1))),
    ("sampling_params", dict(sampling_params=None)),
    ("sampling_params", dict(sampling_params={"height": 16})),
    ("timeout_s", dict(sampling_params=SamplingParams(height=16, width=16, timeout_s=0))),
    ("loras", dict(sampling_params=SamplingParams(height=16, width=16, loras=3))),
    ("loras", dict(sampling_params=SamplingParams(height=16, width=16,
                                                  loras={"a": float("inf")}))),
    ("loras", dict(sampling_params=SamplingParams(height=16, width=16, loras={"": 1.0}))),
]


def poisoned(**kw) -> DiffusionRequest:
    fields = dict(prompt="p", sampling_params=SamplingParams(height=16, width=16,
                                                             num_inference_steps=2, seed=1))
    fields.update(kw)
    return DiffusionRequest(**fields)


@pytest.mark.parametrize("field,kw", POISON, ids=[f"{f}-{i}" for i, (f, _) in enumerate(POISON)])
@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_request_that_cannot_be_carried_is_refused_alone(req_engine4, step_engine4, mode,
                                                           field, kw):
    engine = req_engine4 if mode == "request" else step_engine4

    async def main():
        good = [toy_request(seed=s, steps=3) for s in (1, 2)]
        tasks = [asyncio.create_task(engine.generate_async(r)) for r in good]
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate_async(poisoned(**kw))
        return info.value, await asyncio.gather(*tasks)

    error, outs = asyncio.run(main())
    assert error.field == field
    assert all(o.ok for o in outs)  # its neighbours were served
    assert [pixels(o) for o in outs] == [{toy.expected_pixel(s, 3)} for s in (1, 2)]
    assert engine.is_healthy()
    assert_clean(engine)


def test_a_list_with_a_poisoned_request_submits_nothing(req_engine4):
    good = toy_request(seed=3)
    with pytest.raises(InvalidRequestError, match="seed"):
        req_engine4.generate([good, poisoned(sampling_params=SamplingParams(
            height=16, width=16, seed=2**70))])
    assert req_engine4.num_active_requests() == 0
    assert req_engine4.generate(good).ok  # the good id was never taken


def test_the_extreme_valid_seeds_run(req_engine1):
    for seed in (2**64 - 1, -(2**63), 0):
        out = req_engine1.generate(toy_request(seed=seed))
        assert out.ok and out.seed == seed


def test_the_output_names_the_seed_it_ran_with(req_engine1):
    r = DiffusionRequest(prompt="p", sampling_params=SamplingParams(height=16, width=16,
                                                                    num_inference_steps=2))
    first = req_engine1.generate(r)
    assert isinstance(first.seed, int) and 0 <= first.seed < 2**53  # JSON-safe in any client
    again = req_engine1.generate(toy_request(seed=first.seed, steps=2))
    assert pixels(again) == pixels(first) == {toy.expected_pixel(first.seed, 2)}
    assert r.sampling_params.seed is None  # the caller's request is not modified


def test_the_request_is_copied_at_submission(req_engine1):
    toy.gate("copy").clear()
    r = toy_request("block:copy", seed=5)
    try:
        async def main():
            task = asyncio.create_task(req_engine1.generate_async(r))
            await wait_for(lambda: req_engine1.scheduler.num_running)  # in its forward
            r.prompt = "\ud800"  # mutated after submission: the engine kept its own copy
            r.sampling_params.seed = 2**70
            toy.gate("copy").set()
            return await task
        out = asyncio.run(main())
    finally:
        toy.gate("copy").set()
    assert out.ok and out.seed == 5


@pytest.mark.parametrize("step", [False, True])
def test_request_timeout_ends_a_running_request_with_the_limit_named(step):
    toy.gate("slow").clear()
    try:
        # 1 s: the blocked request times out at it; the one after must finish
        # within it, which a toy request does many times over on a busy machine
        with toy_engine(step_execution=step, max_num_seqs=2, request_timeout_s=1.0,
                        warmup=False) as engine:
            slow = toy_request("block:slow", steps=2)
            out = engine.generate(slow, timeout=60)
            assert not out.ok and not out.aborted
            assert "request_timeout_s=1" in out.error
            toy.gate("slow").set()
            assert engine.generate(toy_request(seed=4), timeout=60).ok  # the engine goes on
            assert_clean(engine)
    finally:
        toy.gate("slow").set()


def test_a_request_may_lower_its_timeout_but_not_raise_it():
    toy.gate("own").clear()
    try:
        with toy_engine(step_execution=True, request_timeout_s=60, warmup=False) as engine:
            out = engine.generate(toy_request("block:own", steps=2, timeout_s=0.2), timeout=20)
            assert "timeout_s=0.2" in out.error
            toy.gate("own").set()
    finally:
        toy.gate("own").set()
    with toy_engine(request_timeout_s=0.2, warmup=False) as engine:
        r = toy_request(steps=2, timeout_s=30)
        assert timeout_of(r, 0.0, engine.config)[1].endswith("(request_timeout_s=0.2)")


def test_a_waiting_request_times_out_too():
    toy.gate("hold").clear()
    try:
        with toy_engine(max_num_seqs=1, request_timeout_s=0.3, warmup=False) as engine:
            async def main():
                running = asyncio.create_task(engine.generate_async(toy_request("block:hold")))
                await wait_for(lambda: engine.scheduler.num_running)  # the blocking one first
                queued = await engine.generate_async(toy_request(seed=9))
                toy.gate("hold").set()
                return queued, await running
            queued, _ = asyncio.run(main())
            assert "request_timeout_s=0.3" in queued.error
            assert queued.metrics.queue_wait is None  # never admitted
    finally:
        toy.gate("hold").set()


def _writer(engine):
    return engine.executor.core.writer  # the in-process worker's output writer


def test_unread_outputs_stay_within_the_bound_and_arrive_intact_when_read():
    """20 consumers stop reading after their first progress output: finished
    outputs wait in the arena (a few fit), the worker waits for room, and when
    the consumers come back every output arrives intact."""
    arena = 64 << 10  # five 64x64 images (12288 bytes each)
    with toy_engine(step_execution=True, max_num_seqs=4, max_pending_output_bytes=arena,
                    warmup=False) as engine:
        requests = [toy_request(seed=s, steps=3, size=64) for s in range(20)]

        async def consumer(r, resume: asyncio.Event):
            agen = engine.step_streaming(r)
            first = await agen.__anext__()
            await resume.wait()
            rest = [o async for o in agen]
            return first, rest[-1]

        async def main():
            resume = asyncio.Event()
            tasks = [asyncio.create_task(consumer(r, resume)) for r in requests]
            # Nobody reads: the arena fills up and the worker waits for room
            # instead of the engine copying outputs into its own memory.
            await wait_for(lambda: _writer(engine).used_bytes == 5 * 12288)  # arena full
            # five outputs landed and wait unread (each is queued as it lands,
            # just after the writer counts its bytes); the others wait in the
            # worker (its output queue is bounded, then its main thread waits too)
            await wait_for(lambda: engine.output_processor.unread_bytes() == 5 * 12288)
            assert engine.num_active_requests() == 20  # nothing dropped, nothing expired
            resume.set()
            return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        for r, (first, final) in zip(requests, results, strict=True):
            assert first.step == 1 and final.ok, final.error
            assert pixels(final) == {toy.expected_pixel(r.sampling_params.seed, 3)}
        assert_clean(engine)
        assert wait_until(lambda: _writer(engine).used_bytes == 0)


def test_an_output_left_unread_expires_and_frees_its_slot():
    with toy_engine(step_execution=True, max_num_seqs=2, unread_output_timeout_s=0.3,
                    warmup=False) as engine:
        async def main():
            agen = engine.step_streaming(toy_request(seed=1, steps=2, size=64))
            await agen.__anext__()  # progress; then the consumer stalls
            await wait_for(engine.output_processor.unread_bytes)  # landed
            await wait_for(lambda: engine.output_processor.unread_bytes() == 0)  # timer freed it
            late = [o async for o in agen]
            other = await engine.generate_async(toy_request(seed=2, steps=2))
            return late[-1], other

        late, other = asyncio.run(main())
        assert late.finished and not late.ok
        assert "output expired" in late.error and "unread_output_timeout_s=0.3" in late.error
        assert other.ok
        assert engine.stats().requests_total == {"success": 1, "error": 0, "aborted": 0,
                                                 "timeout": 1}
        assert_clean(engine)
        assert wait_until(lambda: _writer(engine).used_bytes == 0)


def test_a_consumer_that_leaves_frees_its_output_at_once(step_engine1):
    async def main():
        agen = step_engine1.step_streaming(toy_request(seed=3, steps=2, size=64))
        await agen.__anext__()
        await wait_for(step_engine1.output_processor.unread_bytes)  # landed, unread
        await agen.aclose()
        return step_engine1.output_processor.unread_bytes()

    assert asyncio.run(main()) == 0
    assert_clean(step_engine1)
    assert wait_until(lambda: _writer(step_engine1).used_bytes == 0)


def test_generate_takes_outputs_as_they_finish_whatever_the_order():
    """A list whose first request finishes last: the others' outputs are taken
    meanwhile, so a small arena never stalls on the order of the list."""
    arena = 32 << 10  # two 64x64 images
    with toy_engine(step_execution=True, max_num_seqs=6, max_pending_output_bytes=arena,
                    warmup=False) as engine:
        slow = toy_request(seed=0, steps=40, size=64)
        fast = [toy_request(seed=s, steps=2, size=64) for s in range(1, 6)]
        outs = engine.generate([slow, *fast], timeout=60)
        assert [pixels(o) for o in outs] == \
            [{toy.expected_pixel(0, 40)}] + [{toy.expected_pixel(s, 2)} for s in range(1, 6)]
        assert_clean(engine)


def test_an_id_still_finishing_is_refused_and_nothing_leaks():
    """A request answered early (its timeout expired during a forward that
    cannot be interrupted) keeps its id in the scheduler until that forward
    ends: reusing the id meanwhile is refused, and the rest of the list too."""
    toy.gate("reuse").clear()
    try:
        # 1 s: the request after the gate opens must finish within it too
        with toy_engine(max_num_seqs=1, request_timeout_s=1.0, warmup=False) as engine:
            first = toy_request("block:reuse", rid="same")
            assert "request_timeout_s=1" in engine.generate(first, timeout=60).error
            with pytest.raises(InvalidRequestError, match="still finishing") as info:
                engine.generate([toy_request(rid="other"), toy_request(rid="same")])
            assert info.value.field == "request_id"
            assert engine.num_active_requests() == 0  # "other" was not left behind
            toy.gate("reuse").set()
            wait_until(lambda: not engine.scheduler.has_request("same"))
            assert engine.generate(toy_request(rid="same", seed=6)).ok
            assert_clean(engine)
    finally:
        toy.gate("reuse").set()


def test_a_silent_consumer_delays_others_but_never_fails_them():
    """The arena holds one output. A consumer that stops reading holds it; the
    next request's output waits for room past output_timeout_s without being
    declared lost, and arrives once the silent output expires."""
    with toy_engine(step_execution=True, max_num_seqs=2, max_pending_output_bytes=16 << 10,
                    output_timeout_s=0.2, unread_output_timeout_s=1.0, warmup=False) as engine:
        async def main():
            silent = engine.step_streaming(toy_request(seed=1, steps=2, size=64))
            await silent.__anext__()
            await wait_for(engine.output_processor.unread_bytes)  # its output holds the arena
            reading = await engine.generate_async(toy_request(seed=2, steps=2, size=64))
            late = [o async for o in silent]
            return reading, late[-1]

        reading, late = asyncio.run(main())
        assert reading.ok, reading.error
        assert reading.metrics.output_wait > 0.2  # waited longer than output_timeout_s
        assert "output expired" in late.error
        assert_clean(engine)


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_device_out_of_memory_is_a_request_error(step):
    """An OOM fails only the requests of its tick; a batch that ran out is
    retried one by one (which fits); the cache is freed; the engine serves on."""
    with toy_engine(step_execution=step, max_num_seqs=2, request_batch_max_wait_ms=200,
                    step_batch_max_wait_ms=200, warmup=False) as engine:
        runner = engine.executor.core.runner
        freed = []
        runner.platform.empty_cache = lambda: freed.append(1)
        alone = engine.generate(toy_request("oom", steps=2))
        assert not alone.ok and "device out of memory" in alone.error
        assert freed
        toy.reset()
        batched = engine.generate([toy_request("oom-batched", seed=1, steps=2),
                                   toy_request("p", seed=2, steps=2)])
        assert all(o.ok for o in batched), [o.error for o in batched]
        kind = "step" if step else "forward"
        assert [len(ids) for ids in toy.calls(kind)][:3] == [2, 1, 1]  # ran out together, then alone
        assert engine.is_healthy()
        assert engine.generate(toy_request("p", steps=2)).ok
        assert engine.stats().requests_total["error"] == 1
        assert_clean(engine)
