"""The executor contract on the in-process backend (same code paths as mp, no spawn)."""

from __future__ import annotations

import concurrent.futures
import gc
import time

import pytest
import torch
from runtime_helpers import config, memfd_arenas
from runtime_test_runners import make_tensor

from diffrt.runtime import (
    ExecutorDeadError,
    OutputTimeoutError,
    RunnerOutput,
    WorkerError,
    make_executor,
)


def test_runner_built_with_kwargs_and_platform(inproc):
    [info] = inproc.collective_rpc("info")
    assert info["rank"] == 0 and info["world_size"] == 1
    assert info["kwargs"] == {"tag": "inproc"}
    assert info["platform"] == "cpu"


def test_execute_returns_meta_and_per_key_ids(inproc):
    out = inproc.execute("make", {"keys": ["r1", "r2"], "shape": [4, 5], "dtype": "float32"})
    assert isinstance(out, RunnerOutput)
    assert out.meta["keys"] == ["r1", "r2"]
    assert out.async_output_id is not None  # CPU: packing runs in the background thread
    assert set(out.output_ids) == {"r1", "r2"}
    for i, key in enumerate(["r1", "r2"]):
        lease = inproc.wait_output_ready(out.output_ids[key]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(i, [4, 5], "float32"))


def test_payload_structs_arrive_as_builtins(inproc):
    import msgspec

    class P(msgspec.Struct):
        x: int
        y: list[str]

    out = inproc.execute("echo", P(1, ["a"]))
    assert out.meta == {"x": 1, "y": ["a"]}
    assert out.async_output_id is None and out.output_ids == {}


def test_runner_exception_propagates_and_executor_stays_healthy(inproc):
    with pytest.raises(WorkerError, match="boom 7"):
        inproc.execute("fail", 7)
    with pytest.raises(WorkerError, match="expected RunnerResult"):
        inproc.execute("wrong_type")
    with pytest.raises(WorkerError, match="no_such_method"):
        inproc.execute("no_such_method")
    assert inproc.is_healthy()
    assert inproc.execute("echo", 1).meta == 1


def test_unencodable_payload_is_refused_before_sending(inproc):
    with pytest.raises(TypeError):
        inproc.execute("echo", object())
    assert inproc.router.counts()["rpcs"] == 0
    assert inproc.is_healthy()


def test_sync_output_path_keeps_the_same_contract():
    ex = make_executor("inproc", config(async_output=False, max_pending_output_bytes=1 << 20))
    try:
        out = ex.execute("make", {"keys": ["a"], "shape": [3], "dtype": "uint8"})
        assert out.async_output_id is None  # copied on the worker's main thread
        lease = ex.wait_output_ready(out.output_ids["a"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(0, [3], "uint8"))
    finally:
        ex.shutdown()


def test_output_timeout_fails_the_waiter_and_frees_the_late_output():
    ex = make_executor("inproc", config(output_timeout_s=0.2, max_pending_output_bytes=1 << 20,
                                        _test_faults={"output_delay_s": 0.6}))
    try:
        out = ex.execute("make", {"keys": ["a"], "shape": [8]})
        fut = ex.wait_output_ready(out.output_ids["a"])
        with pytest.raises(OutputTimeoutError):
            fut.result(timeout=10)
        # the late output arrives and is freed, not cached; the pump survived
        deadline = time.monotonic() + 10
        while ex.router.counts()["dropped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.router.counts() == {"rpcs": 0, "waiters": 0, "arrived": 0, "dropped": 0, "claimed": 0}
        assert ex.is_healthy()
        assert ex.execute("echo", 2).meta == 2
    finally:
        ex.shutdown()


def test_shutdown_fails_pending_work_and_later_calls():
    before = memfd_arenas()
    ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20,
                                        _test_faults={"output_delay_s": 0.5}))
    assert memfd_arenas() > before
    out = ex.execute("make", {"keys": ["a"], "shape": [8]})
    fut = ex.wait_output_ready(out.output_ids["a"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(ex.execute, "sleep_then_make", {"sleep_s": 0.3, "keys": ["b"]})
        time.sleep(0.05)
        ex.shutdown()
        with pytest.raises(ExecutorDeadError):
            fut.result(timeout=5)
        with pytest.raises(ExecutorDeadError):
            slow.result(timeout=5)
    assert not ex.is_healthy()
    with pytest.raises(ExecutorDeadError):
        ex.execute("echo", 1)
    with pytest.raises(ExecutorDeadError):
        ex.wait_output_ready("out-1/0").result(timeout=1)
    ex.shutdown()  # idempotent
    gc.collect()
    assert memfd_arenas() == before


def test_inproc_refuses_more_than_one_rank():
    with pytest.raises(ValueError, match="world_size"):
        make_executor("inproc", config(world_size=2))


def test_unknown_backend_and_bad_config():
    with pytest.raises(ValueError, match="backend"):
        make_executor("ray", config())
    with pytest.raises(ValueError, match="runner_cls"):
        config().__class__(runner_cls="nocolon")
    with pytest.raises(ValueError, match="output_timeout_s"):
        config(output_timeout_s=0)


def test_runner_constructor_error_fails_start_up():
    from diffrt.runtime import ExecutorConfig

    with pytest.raises(WorkerError, match="no runner class"):
        make_executor("inproc", ExecutorConfig(runner_cls="runtime_test_runners:Nope"))


def test_output_timeout_env_default(monkeypatch):
    monkeypatch.setenv("DIFFRT_OUTPUT_TIMEOUT_S", "12.5")
    assert config().output_timeout_s == 12.5
    monkeypatch.setenv("DIFFRT_OUTPUT_TIMEOUT_S", "nope")
    with pytest.raises(ValueError, match="DIFFRT_OUTPUT_TIMEOUT_S"):
        config()


def test_lost_output_ready_does_not_leak_its_slot():
    ex = make_executor("inproc", config(output_timeout_s=0.3, max_pending_output_bytes=64 << 10,
                                        _test_faults={"drop_output_ready": 1}))
    try:
        req = {"keys": ["k"], "shape": [40 << 10], "dtype": "uint8"}
        lost = ex.execute("make", req)
        with pytest.raises(OutputTimeoutError):
            ex.wait_output_ready(lost.output_ids["k"]).result(timeout=10)
        # the arena holds one such output: the next one fits only if the lost slot came back
        out = ex.execute("make", req)
        lease = ex.wait_output_ready(out.output_ids["k"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(0, [40 << 10], "uint8"))
        deadline = time.monotonic() + 5
        while ex.core.writer.used_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ex.core.writer.used_bytes == 0
    finally:
        ex.shutdown()


def test_release_while_its_copy_is_queued_frees_everything():
    ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20,
                                        _test_faults={"output_delay_s": 0.3}))
    try:
        out = ex.execute("make", {"keys": ["a", "b"], "shape": [64]})
        ex.release_output(out.output_ids["a"])  # aborted while its copy is still queued
        lease = ex.wait_output_ready(out.output_ids["b"]).result(timeout=10)
        assert torch.equal(lease.take(), make_tensor(1, [64], "float32"))
        deadline = time.monotonic() + 5
        while (ex.router.counts()["dropped"] or ex.core.writer.used_bytes) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ex.router.counts()["dropped"] == 0 and ex.core.writer.used_bytes == 0
    finally:
        ex.shutdown()


def test_worker_spans_show_forward_and_output_on_their_own_tracks(tmp_path):
    import json

    from diffrt import tracing

    tracing.enable(tmp_path)
    try:
        ex = make_executor("inproc", config(max_pending_output_bytes=1 << 20))
        try:
            out = ex.execute("make", {"keys": ["a"], "shape": [8]})
            ex.wait_output_ready(out.output_ids["a"]).result(timeout=10).release()
        finally:
            ex.shutdown()
    finally:
        tracing.disable()
    events = [json.loads(line) for f in tmp_path.glob("trace-*.jsonl")
              for line in f.read_text().splitlines()]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = {(tracks[e["tid"]], e["name"]): e for e in events if e["ph"] == "X"}
    forward = spans[("worker0 main", "forward")]
    assert forward["args"] == {"method": "make", "keys": ["a"]}
    assert ("worker0 output", "d2h+pack") in spans
