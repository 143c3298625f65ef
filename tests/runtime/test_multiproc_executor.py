"""Real worker processes: a focused set sharing one 2-rank executor, plus the
failure cases that need their own (a killed worker, a dead pump, shutdown)."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import signal

import pytest
import torch
from faults import crash_pump_on_output_ready
from leaks import arena_mappings, arena_refs
from runtime_helpers import config
from runtime_test_runners import (
    AllReduce,
    Echo,
    Echoed,
    Fail,
    FailOnRank,
    Info,
    Make,
    Nested,
    Pid,
    Reduced,
    make_tensor,
)
from waiting import wait_until

from diffrt.runtime import ExecutorDeadError, WorkerError
from diffrt.runtime.factory import make_executor

EMPTY = {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}


def _busy(path) -> Make:
    """A 30 s forward that announces its start by creating ``path``."""
    return Make(keys=["b"], sleep_s=30, started_path=str(path))


def _gone(pid: int, within_s: float = 10.0) -> bool:
    def exited() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    return wait_until(exited, timeout=within_s, interval=0.05,
                      message=f"process {pid} still runs")


@pytest.fixture(scope="module")
def mp2():
    ex = make_executor("mp", config(world_size=2, tag="mp",
                                    max_pending_output_bytes=8 << 20))
    yield ex
    pids = ex.worker_pids
    ex.shutdown()
    assert all(_gone(p) for p in pids)


def test_every_rank_runs_its_own_process_with_gloo(mp2):
    infos = mp2.collective_rpc(Info())
    assert [i.rank for i in infos] == [0, 1]
    assert all(i.world_size == 2 and i.tag == "mp" for i in infos)
    pids = [r.pid for r in mp2.collective_rpc(Pid())]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert mp2.collective_rpc(AllReduce(1.0)) == [Reduced(3.0)] * 2  # 1*1 + 1*2 over gloo


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8"])
def test_outputs_cross_processes_bit_exact(mp2, dtype):
    keys = ["r0", "r1", "r2"]
    out = mp2.execute(Make(keys=keys, shape=[3, 17, 5], dtype=dtype, layout="slice"))
    assert out.async_output_id is not None
    for i, key in enumerate(keys):
        lease = mp2.wait_output_ready(out.output_ids[key]).result(timeout=30)
        assert lease.value.dtype == getattr(torch, dtype)  # bf16 stays bf16
        assert lease.nbytes == 3 * 17 * 5 * lease.value.element_size()  # only its own row
        assert torch.equal(lease.take(), make_tensor(i, [3, 17, 5], dtype))


def test_nested_outputs(mp2):
    out = mp2.execute(Nested())
    value = mp2.wait_output_ready(out.output_ids["n"]).result(timeout=30).take()
    assert torch.equal(value["images"][0], make_tensor(0, [2, 2], "uint8"))
    assert value["images"][1].dtype == torch.bfloat16
    assert isinstance(value["pair"], tuple) and value["pair"][1:] == ("label", 3)
    assert value["empty"].shape == (0, 4)
    assert value["scalar"].shape == () and value["scalar"].item() == 2.5


def test_errors_from_any_rank_propagate(mp2):
    with pytest.raises(WorkerError, match="rank [01]: ValueError: boom x"):
        mp2.execute(Fail("x"))
    with pytest.raises(WorkerError, match="boom on rank 1"):
        mp2.execute(FailOnRank(1))
    assert mp2.is_healthy()
    assert mp2.execute(Echo([1, 2])).reply == Echoed([1, 2])
    # rank 0's output of the failed rpc is freed on arrival
    wait_until(lambda: mp2.router.counts() == EMPTY, message=lambda: str(mp2.router.counts()))


def test_control_rpc_while_outputs_pending(mp2):
    out = mp2.execute(Make(keys=["a"], shape=[1000]))
    assert len(mp2.collective_rpc(Info())) == 2  # not stuck behind the output future
    assert torch.equal(mp2.wait_output_ready(out.output_ids["a"]).result(timeout=30).take(),
                       make_tensor(0, [1000], "float32"))


def test_terminal_ctrl_c_does_not_kill_workers(mp2):
    # Ctrl-C reaches the whole process group; the engine owns the shutdown.
    for pid in mp2.worker_pids:
        os.kill(pid, signal.SIGINT)
    # A worker that did not ignore SIGINT would die at its next signal check,
    # at the latest when the request below wakes it: two round trips later it
    # would be gone.
    for i in range(2):
        assert [r.pid for r in mp2.collective_rpc(Pid())] == mp2.worker_pids
        assert mp2.execute(Echo([i])).reply == Echoed([i])
    assert mp2.is_healthy()


def test_worker_sigkill_mid_forward_fails_pending_work_fast(tmp_path):
    gc.collect()  # arenas of earlier tests still viewed by garbage go first
    held_before = arena_refs(os.getpid())
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20))
    try:
        [pid] = ex.worker_pids
        assert arena_mappings(pid) == 1 and arena_refs(os.getpid()) > held_before
        first = ex.execute(Make(keys=["a"], shape=[8]))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(ex.execute, _busy(tmp_path / "started"))
            wait_until(lambda: (tmp_path / "started").exists())  # the worker is in forward
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ExecutorDeadError, match="killed by signal 9"):
                busy.result(timeout=10)
        assert not ex.is_healthy()
        # every pending or unclaimed output fails too; new work fails at once
        with pytest.raises(ExecutorDeadError):
            ex.wait_output_ready(first.output_ids["a"]).result(timeout=5)
        with pytest.raises(ExecutorDeadError):
            ex.execute(Echo(1))
        with pytest.raises(ExecutorDeadError):
            ex.wait_output_ready("out-99/0").result(timeout=5)
    finally:
        ex.shutdown()
    assert _gone(pid)
    gc.collect()
    assert arena_refs(os.getpid()) == held_before  # the executor unmapped and closed its arena


def test_exception_in_the_pump_fails_pending_work_and_marks_unhealthy(monkeypatch):
    crash_pump_on_output_ready(monkeypatch)
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20))
    try:
        out = ex.execute(Make(keys=["a"], shape=[8]))  # COMPUTE_DONE still routed
        with pytest.raises(ExecutorDeadError, match="result pump died"):
            ex.wait_output_ready(out.output_ids["a"]).result(timeout=10)
        assert not ex.is_healthy()
        with pytest.raises(ExecutorDeadError):
            ex.execute(Echo(1))
    finally:
        pids = ex.worker_pids
        ex.shutdown()
    assert all(_gone(p) for p in pids)


def test_shutdown_with_work_in_flight_escalates_and_fails_it(tmp_path):
    ex = make_executor("mp", config(max_pending_output_bytes=1 << 20, shutdown_grace_s=0.5))
    [pid] = ex.worker_pids
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(ex.execute, _busy(tmp_path / "started"))
        wait_until(lambda: (tmp_path / "started").exists())  # the worker is in forward
        ex.shutdown()  # the worker is busy for 30 s: ask, then terminate
        with pytest.raises(ExecutorDeadError, match="shut down"):
            busy.result(timeout=10)
    assert _gone(pid, within_s=1.0)
    assert not ex.is_healthy()


def test_full_arena_waits_for_the_engine_to_free_across_processes(mp2):
    req = Make(keys=["k"], shape=[5 << 20], dtype="uint8")  # two do not fit in 8 MiB
    first = mp2.execute(req)
    lease = mp2.wait_output_ready(first.output_ids["k"]).result(timeout=30)
    second = mp2.execute(req)
    fut = mp2.wait_output_ready(second.output_ids["k"])
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=0.5)  # the writer waits for room
    assert torch.equal(lease.take(), make_tensor(0, [5 << 20], "uint8"))  # frees via the pipe
    assert torch.equal(fut.result(timeout=30).take(), make_tensor(0, [5 << 20], "uint8"))


def test_runner_constructor_error_in_a_worker_fails_start_up():
    cfg = config(runner_cls="runtime_test_runners:NoSuchRunner")
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
    from diffrt.platforms.rocm import RocmPlatform

    class FakeRocm(RocmPlatform):
        def device_count(self) -> int:
            return 4

    rocm = FakeRocm()
    assert worker_device_env(rocm, 1, 2, {}) == {"HIP_VISIBLE_DEVICES": "1"}
    # the caller narrowed with ROCR_VISIBLE_DEVICES only: pinned through it
    assert worker_device_env(rocm, 1, 2, {"ROCR_VISIBLE_DEVICES": "2,3"}) == \
        {"ROCR_VISIBLE_DEVICES": "3"}
    # HIP indexes inside ROCR's selection: the innermost the caller set wins
    assert worker_device_env(rocm, 0, 2, {"ROCR_VISIBLE_DEVICES": "2,3",
                                          "HIP_VISIBLE_DEVICES": "1,0"}) == \
        {"HIP_VISIBLE_DEVICES": "1"}
    from diffrt.platforms.cpu import CpuPlatform

    assert worker_device_env(CpuPlatform(), 1, 2, {}) == {}
