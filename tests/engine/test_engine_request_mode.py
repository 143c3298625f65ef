"""REQUEST_BATCH through the engine on the in-process executor (toy model)."""

from __future__ import annotations

import threading

import engine_toy as toy
import numpy as np
import pytest
from engine_helpers import assert_clean, toy_engine, toy_request, wait_until
from faults import crash_pump_on_output_ready, hold_outputs

from diffrt.engine import DiffusionOutput, InvalidRequestError


def pixels(out: DiffusionOutput) -> set[int]:
    return {int(v) for img in out.images for v in np.unique(np.asarray(img))}


def test_single_request_gives_pil_images_and_metrics(req_engine1):
    r = toy_request(seed=3, steps=5, size=24, num_outputs_per_prompt=2)
    out = req_engine1.generate(r)
    assert out.ok and out.request_id == r.request_id
    assert len(out.images) == 2 and out.images[0].size == (24, 24)
    assert pixels(out) == {toy.expected_pixel(3, 5)}
    assert (out.step, out.total_steps) == (5, 5)
    m = out.metrics
    for value in (m.queue_wait, m.forward_time, m.output_wait, m.postprocess_time):
        assert value is not None and value >= 0
    assert m.finished_time >= m.arrival_time
    assert_clean(req_engine1)


def test_output_type_pt_returns_the_tensor(req_engine1):
    out = req_engine1.generate(toy_request(seed=4, output_type="pt"))
    assert out.ok and out.images is None
    assert tuple(out.output.shape) == (1, 16, 16, 3)
    assert int(out.output.flatten()[0]) == toy.expected_pixel(4, 2)


def test_serial_engine_runs_one_request_per_forward(req_engine1):
    toy.reset()
    reqs = [toy_request(seed=i) for i in range(3)]
    outs = req_engine1.generate(reqs)
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]
    assert all(o.ok for o in outs)
    assert toy.calls("forward") == [[r.request_id] for r in reqs]


def test_fused_engine_batches_compatible_requests(req_engine4):
    toy.reset()
    reqs = [toy_request(seed=i) for i in range(6)]
    outs = req_engine4.generate(reqs)
    assert [pixels(o) for o in outs] == [{toy.expected_pixel(i, 2)} for i in range(6)]
    ids = [r.request_id for r in reqs]
    assert toy.calls("forward") == [ids[:4], ids[4:]]


def test_incompatible_requests_go_in_separate_waves(req_engine4):
    toy.reset()
    reqs = [toy_request(size=16), toy_request(size=32), toy_request(size=16)]
    outs = req_engine4.generate(reqs)
    assert all(o.ok for o in outs)
    a, b, c = (r.request_id for r in reqs)
    assert toy.calls("forward") == [[a], [b], [c]]  # fifo: the 32px request blocks c


def test_skip_ahead_policy_lets_a_compatible_request_join():
    with toy_engine(max_num_seqs=4, scheduling_policy="skip_ahead") as engine:
        toy.reset()
        reqs = [toy_request(size=16), toy_request(size=32), toy_request(size=16)]
        assert all(o.ok for o in engine.generate(reqs))
        a, b, c = (r.request_id for r in reqs)
        assert toy.calls("forward") == [[a, c], [b]]


def test_error_in_a_fused_batch_fails_only_its_request(req_engine4):
    toy.reset()
    reqs = [toy_request(seed=1), toy_request("fail"), toy_request(seed=2)]
    outs = req_engine4.generate(reqs)
    assert outs[0].ok and outs[2].ok
    assert pixels(outs[0]) == {toy.expected_pixel(1, 2)}
    assert pixels(outs[2]) == {toy.expected_pixel(2, 2)}
    assert outs[1].finished and not outs[1].ok
    assert "toy failure in " + reqs[1].request_id in outs[1].error
    assert req_engine4.is_healthy()
    # The fused call failed, then each member ran alone.
    assert toy.calls("forward")[0] == [r.request_id for r in reqs]
    assert_clean(req_engine4)


def test_invalid_sampling_params_refused_at_submission(req_engine1):
    with pytest.raises(InvalidRequestError) as info:
        req_engine1.generate(toy_request(size=20))  # not a multiple of 8
    assert info.value.field == "height"
    with pytest.raises(InvalidRequestError, match="num_inference_steps"):
        req_engine1.generate([toy_request(), toy_request(steps=0)])
    assert req_engine1.num_active_requests() == 0  # nothing of the list was submitted
    assert req_engine1.generate(toy_request()).ok


def _blocked(engine, gate_name: str, **kw):
    """Submit a request that blocks in forward; returns (thread, result list)."""
    request = toy_request(f"block:{gate_name}", **kw)
    result: list = []
    t = threading.Thread(target=lambda: result.append(engine.generate(request)))
    t.start()
    assert wait_until(lambda: any(request.request_id in ids for ids in toy.calls("forward")))
    return request, t, result


def test_duplicate_active_request_id_refused(req_engine1):
    toy.gate("dup").clear()
    first, t, result = _blocked(req_engine1, "dup")
    try:
        with pytest.raises(InvalidRequestError) as info:
            req_engine1.generate(toy_request(rid=first.request_id))
        assert info.value.field == "request_id"
    finally:
        toy.gate("dup").set()
    t.join(10)
    assert result[0].ok
    assert req_engine1.generate(toy_request(rid=first.request_id)).ok  # free again


def test_abort_waiting_request(req_engine1):
    toy.gate("aw").clear()
    first, t, result = _blocked(req_engine1, "aw")
    try:
        waiting = toy_request()
        got: list = []
        t2 = threading.Thread(target=lambda: got.append(req_engine1.generate(waiting)))
        t2.start()
        assert wait_until(lambda: req_engine1.scheduler.num_waiting == 1)
        req_engine1.abort(waiting.request_id)
        t2.join(10)
        assert got[0].aborted and got[0].finished and not got[0].ok
    finally:
        toy.gate("aw").set()
    t.join(10)
    assert result[0].ok
    assert all(waiting.request_id not in ids for ids in toy.calls("forward"))
    assert_clean(req_engine1)


def test_abort_while_running_drops_the_output(req_engine1):
    """Abort between schedule and update: the forward completes, its output is freed."""
    toy.gate("ar").clear()
    running, t, result = _blocked(req_engine1, "ar")
    req_engine1.abort(running.request_id)
    req_engine1.abort(running.request_id)  # twice: no-op
    toy.gate("ar").set()
    t.join(10)
    assert result[0].aborted and result[0].images is None
    assert_clean(req_engine1)
    req_engine1.abort(running.request_id)  # finished id: no-op
    req_engine1.abort("never-existed")
    assert req_engine1.is_healthy()


def test_late_output_of_an_aborted_request_is_dropped_and_freed(monkeypatch):
    """The output reaches the host only after the abort: it is released, not delivered."""
    copy = hold_outputs(monkeypatch)
    with toy_engine(max_num_seqs=1, warmup=False) as engine:
        r = toy_request(size=64)
        got: list = []
        t = threading.Thread(target=lambda: got.append(engine.generate(r)))
        t.start()
        # Compute done, output still in the (held) output thread.
        assert wait_until(lambda: engine.output_processor.output_id_of(r.request_id))
        engine.abort(r.request_id)
        router = engine.executor.router
        # The engine told the runtime it will never read it...
        assert router.counts()["dropped"] == 1 and router.counts()["waiting"] == 0
        copy.set()
        t.join(10)
        assert got[0].aborted and got[0].images is None
        # ...so the late OUTPUT_READY is freed on arrival, never parked.
        assert wait_until(lambda: router.counts()["dropped"] == 0)
        assert router.counts()["arrived"] == 0
        assert engine.is_healthy()
        assert_clean(engine)


def test_admission_window_coalesces_a_burst():
    # A long window (its "queue stable" part is a quarter of it) so a loaded
    # machine cannot make b miss it.
    with toy_engine(max_num_seqs=4, request_batch_max_wait_ms=1200) as engine:
        toy.reset()
        a, b = toy_request(), toy_request()
        outs: list = []
        t = threading.Thread(target=lambda: outs.append(engine.generate(a)))
        t.start()
        assert wait_until(lambda: engine.num_active_requests() == 1)
        outs.append(engine.generate(b))  # arrives well inside the window
        t.join(10)
        assert all(o.ok for o in outs)
        assert toy.calls("forward")[-1] == [a.request_id, b.request_id]


def test_without_window_the_first_request_goes_alone(req_engine4):
    toy.reset()
    toy.gate("nw").clear()
    first, t, result = _blocked(req_engine4, "nw")
    second = toy_request()
    got: list = []
    t2 = threading.Thread(target=lambda: got.append(req_engine4.generate(second)))
    t2.start()
    toy.gate("nw").set()
    t.join(10)
    t2.join(10)
    assert toy.calls("forward") == [[first.request_id], [second.request_id]]


def test_hung_warmup_fails_with_an_error_and_cleans_up():
    from diffrt.engine import EngineWarmupError

    def engine_threads():
        return sum(t.name == "diffrt-engine-loop" for t in threading.enumerate())

    before = engine_threads()
    toy.gate("hang").clear()
    try:
        with pytest.raises(EngineWarmupError, match="warmup_timeout_s"):
            toy_engine(model="toy-hang", warmup_timeout_s=0.5,
                       shutdown_grace_s=0.2)
        assert wait_until(lambda: engine_threads() == before)  # its loop is gone too
    finally:
        toy.gate("hang").set()


def test_close_sends_error_to_open_streams_and_refuses_new_work():
    from diffrt.engine import EngineClosedError

    engine = toy_engine(max_num_seqs=1)
    toy.gate("close").clear()
    blocked, t, result = _blocked(engine, "close")
    waiting = toy_request()
    got: list = []
    t2 = threading.Thread(target=lambda: got.append(engine.generate(waiting)))
    t2.start()
    assert wait_until(lambda: engine.num_active_requests() == 2)
    closer = threading.Thread(target=engine.close)
    closer.start()
    t2.join(10)
    assert got[0].finished and got[0].error == "engine closed"
    toy.gate("close").set()
    closer.join(20)
    t.join(10)
    assert result[0].finished and not result[0].ok
    assert not engine.is_healthy()
    with pytest.raises(EngineClosedError):
        engine.generate(toy_request())
    engine.close()  # idempotent


def test_generate_timeout_aborts_what_is_unfinished(req_engine1):
    toy.gate("to").clear()
    r = toy_request("block:to")
    try:
        with pytest.raises(TimeoutError):
            req_engine1.generate(r, timeout=0.2)
        assert req_engine1.output_processor.num_streams() == 0
    finally:
        toy.gate("to").set()
    assert_clean(req_engine1)


def test_streaming_in_request_mode_yields_the_final_only(req_engine4):
    import asyncio

    async def main():
        outs = [o async for o in req_engine4.step_streaming(toy_request(seed=9, steps=3))]
        final = await req_engine4.generate_async(toy_request(seed=9, steps=3))
        return outs, final

    outs, final = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished and outs[0].ok
    assert pixels(outs[0]) == pixels(final) == {toy.expected_pixel(9, 3)}


def test_pump_death_fails_the_request_and_marks_the_engine_unhealthy(monkeypatch):
    from diffrt.engine import EngineDeadError

    crash_pump_on_output_ready(monkeypatch)
    with toy_engine(warmup=False) as engine:
        out = engine.generate(toy_request(), timeout=30)
        assert out.finished and not out.ok and "ExecutorDeadError" in out.error
        assert wait_until(lambda: not engine.is_healthy())
        with pytest.raises(EngineDeadError):
            engine.generate(toy_request())


def test_a_dict_is_refused_as_not_a_request(req_engine1):
    """generate({"prompt": ...}) names what it got, not "got str" (its keys)."""
    with pytest.raises(InvalidRequestError, match="must be a DiffusionRequest or a list of "
                                                  "them, got dict") as info:
        req_engine1.generate({"prompt": "a fox"})
    assert info.value.field == "request"
