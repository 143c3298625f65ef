"""Real worker processes: a focused set sharing one 2-rank executor, plus the
failure cases that need their own (a killed worker, a dead pump, shutdown)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest
import torch
from runtime_helpers import config
from runtime_test_runners import make_tensor

from diffrt.runtime import ExecutorDeadError, WorkerError, make_executor


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def mp2():
    ex = make_executor("mp", config(world_size=2, runner_kwargs={"tag": "mp"},
                                    max_pending_output_bytes=8 << 20))
    yield ex
    pids = ex.worker_pids
    ex.shutdown()
    assert all(_gone(p) for p in pids)


def test_every_rank_runs_its_own_process_with_gloo(mp2):
    infos = mp2.collective_rpc("info")
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 and i["kwargs"] == {"tag": "mp"} for i in infos)
    pids = mp2.collective_rpc("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert mp2.collective_rpc("allreduce", 1.0) == [3.0, 3.0]  # 1*1 + 1*2 over gloo


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8"])
def test_outputs_cross_processes_bit_exact(mp2, dtype):
    keys = ["r0", "r1", "r2"]
    out = mp2.execute("make", {"keys": keys, "shape": [3, 17, 5], "dtype": dtype, "layout": "slice"})
    assert out.async_output_id is not None
    for i, key in enumerate(keys):
        lease = mp2.wait_output_ready(out.output_ids[key]).result(timeout=30)
        assert lease.value.dtype == getattr(torch, dtype)  # bf16 stays bf16
        assert lease.nbytes == 3 * 17 * 5 * lease.value.element_size()  # only its own row
        assert torch.equal(lease.take(), make_tensor(i, [3, 17, 5], dtype))


def test_nested_outputs(mp2):
    out = mp2.execute("nested")
    value = mp2.wait_output_ready(out.output_ids["n"]).result(timeout=30).take()
    assert torch.equal(value["images"][0], make_tensor(0, [2, 2], "uint8"))
    assert value["images"][1].dtype == torch.bfloat16
    assert isinstance(value["pair"], tuple) and value["pair"][1:] == ("label", 3)
    assert value["empty"].shape == (0, 4)
    assert value["scalar"].shape == () and value["scalar"].item() == 2.5


def test_errors_from_any_rank_propagate(mp2):
    with pytest.raises(WorkerError, match="rank [01]: ValueError: boom x"):
        mp2.execute("fail", "x")
    with pytest.raises(WorkerError, match="boom on rank 1"):
        mp2.execute("fail_on_rank", 1)
    assert mp2.is_healthy()
    assert mp2.execute("echo", [1, 2]).meta == [1, 2]
    deadline = time.monotonic() + 5
    while mp2.router.counts()["dropped"] and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 0's output of the failed rpc is freed on arrival
    assert mp2.router.counts() == {"rpcs": 0, "waiters": 0, "arrived": 0, "dropped": 0, "claimed": 0}


def test_control_rpc_while_outputs_pending(mp2):
    out = mp2.execute("make", {"keys": ["a"], "shape": [1000]})
    assert len(mp2.collective_rpc("info")) == 2  # not stuck behind the output future
    assert torch.equal(mp2.wait_output_ready(out.output_ids["a"]).result(timeout=30).take(),
                       make_tensor(0, [1000], "float32"))


def test_terminal_ctrl_c_does_not_kill_workers(mp2):
    # Ctrl-C reaches the whole process group; the engine owns the shutdown.
    for pid in mp2.worker_pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    assert mp2.is_healthy()
    assert mp2.execute("echo", [7]).meta == [7]


def test_worker_sigkill_mid_forward_fails_pending_work_fast():
    shm_before = _dev_shm()
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20))
    try:
        [pid] = ex.worker_pids
        first = ex.execute("make", {"keys": ["a"], "shape": [8]})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(ex.execute, "sleep_then_make", {"sleep_s": 30, "keys": ["b"]})
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ExecutorDeadError, match="killed by signal 9"):
                busy.result(timeout=10)
        assert not ex.is_healthy()
        # every pending or unclaimed output fails too; new work fails at once
        with pytest.raises(ExecutorDeadError):
            ex.wait_output_ready(first.output_ids["a"]).result(timeout=5)
        with pytest.raises(ExecutorDeadError):
            ex.execute("echo", 1)
        with pytest.raises(ExecutorDeadError):
            ex.wait_output_ready("out-99/0").result(timeout=5)
    finally:
        ex.shutdown()
    assert _gone(pid)
    assert _dev_shm() == shm_before


def test_exception_in_the_pump_fails_pending_work_and_marks_unhealthy():
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20,
                                    _test_faults={"pump_raise_on": "output_ready"}))
    try:
        out = ex.execute("make", {"keys": ["a"], "shape": [8]})  # COMPUTE_DONE still routed
        with pytest.raises(ExecutorDeadError, match="result pump died"):
            ex.wait_output_ready(out.output_ids["a"]).result(timeout=10)
        assert not ex.is_healthy()
        with pytest.raises(ExecutorDeadError):
            ex.execute("echo", 1)
    finally:
        pids = ex.worker_pids
        ex.shutdown()
    assert all(_gone(p) for p in pids)


def test_shutdown_with_work_in_flight_escalates_and_fails_it():
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20, shutdown_grace_s=0.5))
    [pid] = ex.worker_pids
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(ex.execute, "sleep_then_make", {"sleep_s": 30, "keys": ["b"]})
        time.sleep(0.3)
        ex.shutdown()  # the worker is busy for 30 s: ask, then terminate
        with pytest.raises(ExecutorDeadError, match="shut down"):
            busy.result(timeout=10)
    assert _gone(pid, within_s=1.0)
    assert not ex.is_healthy()


def test_full_arena_waits_for_the_engine_to_free_across_processes(mp2):
    req = {"keys": ["k"], "shape": [5 << 20], "dtype": "uint8"}  # two do not fit in 8 MiB
    first = mp2.execute("make", req)
    lease = mp2.wait_output_ready(first.output_ids["k"]).result(timeout=30)
    second = mp2.execute("make", req)
    fut = mp2.wait_output_ready(second.output_ids["k"])
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=0.5)  # the writer waits for room
    assert torch.equal(lease.take(), make_tensor(0, [5 << 20], "uint8"))  # frees via the pipe
    assert torch.equal(fut.result(timeout=30).take(), make_tensor(0, [5 << 20], "uint8"))


def test_runner_constructor_error_in_a_worker_fails_start_up():
    cfg = config()
    cfg.runner_cls = "runtime_test_runners:NoSuchRunner"
    with pytest.raises(WorkerError, match="NoSuchRunner"):
        make_executor("mp", cfg)


def test_each_rank_is_pinned_to_its_own_device():
    from diffrt.runtime.multiproc_executor import worker_device_env

    class FakeGpu:
        device_type = "cuda"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        def device_count(self) -> int:
            return 4

    gpu = FakeGpu()
    assert worker_device_env(gpu, 1, 2, {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert worker_device_env(gpu, 1, 2, {"CUDA_VISIBLE_DEVICES": "5,7"}) == \
        {"CUDA_VISIBLE_DEVICES": "7"}
    assert worker_device_env(gpu, 0, 1, {}) == {}  # one rank keeps the caller's view
    from diffrt.platforms.cpu import CpuPlatform

    assert worker_device_env(CpuPlatform(), 1, 2, {}) == {}
