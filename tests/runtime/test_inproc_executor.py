"""The executor contract on the in-process backend (same code paths as mp, no spawn)."""

from __future__ import annotations

import concurrent.futures
import gc
import os

import pytest
import torch
from faults import drop_output_ready, hold_outputs
from leaks import arena_refs
from runtime_helpers import config, runner_spec
from runtime_test_runners import (
    Echo,
    Echoed,
    Fail,
    Info,
    Made,
    Make,
    NotDeclared,
    WrongType,
    make_tensor,
)
from waiting import wait_until

from diffrt.runtime import (
    ExecutorConfig,
    ExecutorDeadError,
    OutputTimeoutError,
    RunnerOutput,
    RunnerSpec,
    WorkerError,
)
from diffrt.runtime.factory import make_executor

EMPTY = {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}


def test_runner_built_with_settings_and_platform(inproc):
    [info] = inproc.collective_rpc(Info())
    assert info.rank == 0 and info.world_size == 1
    assert info.tag == "inproc"
    assert info.platform == "cpu"


def test_execute_returns_typed_reply_and_per_key_ids(inproc):
    out = inproc.execute(Make(keys=["r1", "r2"], shape=[4, 5], dtype="float32"))
    assert isinstance(out, RunnerOutput)
    assert isinstance(out.reply, Made) and out.reply.keys == ["r1", "r2"]
    assert out.async_output_id is not None  # CPU: packing runs in the background thread
    assert set(out.output_ids) == {"r1", "r2"}
    for i, key in enumerate(["r1", "r2"]):
        lease = inproc.wait_output_ready(out.output_ids[key]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(i, [4, 5], "float32"))


def test_requests_and_replies_cross_as_their_own_types(inproc):
    out = inproc.execute(Echo({"x": 1, "y": ["a"]}))
    assert out.reply == Echoed({"x": 1, "y": ["a"]})
    assert out.async_output_id is None and out.output_ids == {}


def test_runner_exception_propagates_and_executor_stays_healthy(inproc):
    with pytest.raises(WorkerError, match="boom 7"):
        inproc.execute(Fail(7))
    with pytest.raises(WorkerError, match="expected RunnerResult"):
        inproc.execute(WrongType())
    assert inproc.is_healthy()
    assert inproc.execute(Echo(1)).reply == Echoed(1)


@pytest.mark.parametrize("bad", [NotDeclared(), "make", {"keys": ["a"]}, None])
def test_a_request_the_runner_does_not_declare_is_a_type_error_before_sending(inproc, bad):
    with pytest.raises(TypeError, match="not a request of this runner"):
        inproc.execute(bad)
    with pytest.raises(TypeError, match="not a request of this runner"):
        inproc.collective_rpc(bad)
    assert inproc.router.counts()["rpcs"] == 0
    assert inproc.is_healthy()


def test_unencodable_request_is_refused_before_sending(inproc):
    with pytest.raises(TypeError):
        inproc.execute(Echo(object()))
    assert inproc.router.counts()["rpcs"] == 0
    assert inproc.is_healthy()


def test_sync_output_path_keeps_the_same_contract():
    ex = make_executor("inproc", config(async_output=False, max_pending_output_bytes=1 << 20))
    try:
        out = ex.execute(Make(keys=["a"], shape=[3], dtype="uint8"))
        assert out.async_output_id is None  # copied on the worker's main thread
        lease = ex.wait_output_ready(out.output_ids["a"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(0, [3], "uint8"))
    finally:
        ex.shutdown()


def test_output_timeout_fails_the_waiter_and_frees_the_late_output(monkeypatch):
    copy = hold_outputs(monkeypatch)
    ex = make_executor("inproc", config(output_timeout_s=0.2, max_pending_output_bytes=1 << 20))
    try:
        out = ex.execute(Make(keys=["a"], shape=[8]))
        fut = ex.wait_output_ready(out.output_ids["a"])
        with pytest.raises(OutputTimeoutError):
            fut.result(timeout=10)
        copy.set()
        # the late output arrives and is freed, not cached; the pump survived
        wait_until(lambda: ex.router.counts()["dropped"] == 0, message=str(ex.router.counts()))
        assert ex.router.counts() == EMPTY
        assert ex.is_healthy()
        assert ex.execute(Echo(2)).reply == Echoed(2)
    finally:
        ex.shutdown()


def test_shutdown_fails_pending_work_and_later_calls(monkeypatch):
    hold_outputs(monkeypatch)  # never released: the output is pending at shutdown
    gc.collect()  # arenas of earlier tests still viewed by garbage go first
    before = arena_refs(os.getpid())
    ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20))
    assert arena_refs(os.getpid()) > before
    out = ex.execute(Make(keys=["a"], shape=[8]))
    fut = ex.wait_output_ready(out.output_ids["a"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(ex.execute, Make(keys=["b"], sleep_s=0.3))
        wait_until(lambda: ex.router.counts()["rpcs"] == 1)  # the slow execute is in flight
        ex.shutdown()
        with pytest.raises(ExecutorDeadError):
            fut.result(timeout=5)
        with pytest.raises(ExecutorDeadError):
            slow.result(timeout=5)
    assert not ex.is_healthy()
    with pytest.raises(ExecutorDeadError):
        ex.execute(Echo(1))
    with pytest.raises(ExecutorDeadError):
        ex.wait_output_ready("out-1/0").result(timeout=1)
    ex.shutdown()  # idempotent
    gc.collect()
    assert arena_refs(os.getpid()) == before


def test_inproc_refuses_more_than_one_rank():
    with pytest.raises(ValueError, match="world_size"):
        make_executor("inproc", config(world_size=2))


def test_unknown_backend_and_bad_config():
    from runtime_test_runners import ECHO_PROTOCOL, EchoSettings, Pid

    with pytest.raises(ValueError, match="backend"):
        make_executor("slurm", config())
    with pytest.raises(ValueError, match="runner cls"):
        RunnerSpec("nocolon", ECHO_PROTOCOL, EchoSettings())
    with pytest.raises(TypeError, match="settings"):
        RunnerSpec("runtime_test_runners:EchoRunner", ECHO_PROTOCOL, Pid())
    with pytest.raises(TypeError, match="RunnerSpec"):
        ExecutorConfig(runner="runtime_test_runners:EchoRunner")
    with pytest.raises(ValueError, match="output_timeout_s"):
        config(output_timeout_s=0)


def test_runner_constructor_error_fails_start_up():
    with pytest.raises(WorkerError, match="no runner class"):
        make_executor("inproc", ExecutorConfig(runner=runner_spec(cls="runtime_test_runners:Nope")))


def test_output_timeout_env_default(monkeypatch):
    monkeypatch.setenv("DIFFRT_OUTPUT_TIMEOUT_S", "12.5")
    assert config().output_timeout_s == 12.5
    monkeypatch.setenv("DIFFRT_OUTPUT_TIMEOUT_S", "nope")
    with pytest.raises(ValueError, match="DIFFRT_OUTPUT_TIMEOUT_S"):
        config()


def test_lost_output_ready_does_not_leak_its_slot(monkeypatch):
    drop_output_ready(monkeypatch, 1)
    ex = make_executor("inproc", config(output_timeout_s=0.3, max_pending_output_bytes=64 << 10))
    try:
        req = Make(keys=["k"], shape=[40 << 10], dtype="uint8")
        lost = ex.execute(req)
        with pytest.raises(OutputTimeoutError):
            ex.wait_output_ready(lost.output_ids["k"]).result(timeout=10)
        # the arena holds one such output: the next one fits only if the lost slot came back
        out = ex.execute(req)
        lease = ex.wait_output_ready(out.output_ids["k"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(0, [40 << 10], "uint8"))
        lease.release()
        wait_until(lambda: ex.core.writer.used_bytes == 0)
    finally:
        ex.shutdown()


def test_release_while_its_copy_is_queued_frees_everything(monkeypatch):
    copy = hold_outputs(monkeypatch)
    ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20))
    try:
        out = ex.execute(Make(keys=["a", "b"], shape=[64]))
        ex.release_output(out.output_ids["a"])  # aborted while its copy is still queued
        copy.set()
        lease = ex.wait_output_ready(out.output_ids["b"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(1, [64], "float32"))
        lease.release()
        wait_until(lambda: ex.router.counts()["dropped"] == 0 and ex.core.writer.used_bytes == 0,
                   message=str(ex.router.counts()))
    finally:
        ex.shutdown()


def test_worker_spans_show_forward_and_output_on_their_own_tracks(tmp_path):
    import json

    from diffrt import tracing

    tracing.enable(tmp_path)
    try:
        ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20))
        try:
            out = ex.execute(Make(keys=["a"], shape=[8]))
            ex.wait_output_ready(out.output_ids["a"]).result(timeout=10).release()
        finally:
            ex.shutdown()
    finally:
        tracing.disable()
    events = [json.loads(line) for f in tmp_path.glob("trace-*.jsonl")
              for line in f.read_text().splitlines()]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = {(tracks[e["tid"]], e["name"]): e for e in events if e["ph"] == "X"}
    forward = spans[(tracing.worker_main_track(0), tracing.FORWARD_SPAN)]
    assert forward["args"] == {"request": "Make", "keys": ["a"]}
    assert (tracing.worker_output_track(0), tracing.COPY_SPAN) in spans


def test_a_protocol_lists_tagged_structs_only():
    import msgspec
    from runtime_test_runners import EchoSettings

    from diffrt.runtime import RunnerProtocol

    class Untagged(msgspec.Struct):
        x: int = 0

    with pytest.raises(TypeError, match="not a tagged msgspec Struct"):
        RunnerProtocol(settings=EchoSettings, requests=Echo | Untagged, replies=Echoed)
    with pytest.raises(TypeError, match="not a tagged msgspec Struct"):
        RunnerProtocol(settings=EchoSettings, requests=Echo, replies=dict)


def test_a_runner_class_without_a_protocol_fails_start_up():
    with pytest.raises(WorkerError, match="no 'protocol'"):
        make_executor("inproc", config(runner_cls="runtime_helpers:config"))


def test_a_reply_outside_the_protocol_fails_that_call_only(inproc):
    from runtime_test_runners import ReplyOutsideProtocol

    with pytest.raises(WorkerError, match="does not declare"):
        inproc.execute(ReplyOutsideProtocol())
    with pytest.raises(WorkerError, match="does not declare"):
        inproc.collective_rpc(ReplyOutsideProtocol(collective=True))
    assert inproc.is_healthy()
    assert inproc.execute(Echo(3)).reply == Echoed(3)
    wait_until(lambda: inproc.router.counts() == EMPTY, message=lambda: str(inproc.router.counts()))
