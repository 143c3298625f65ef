"""The engine on the multiprocess executor with async output (real tiny-flux in
spawned workers): both modes, streams, worker death, nothing left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from leaks import INPUT_ARENA_NAME, alive, arena_mappings, arena_refs
from PIL import Image
from waiting import wait_until

from diffrt.engine import (
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    EngineDeadError,
    SamplingParams,
)
from diffrt.engine.runner_messages import CountStepStates, StepStateCount


def req(seed: int, steps: int = 3, size: tuple[int, int] = (64, 64)) -> DiffusionRequest:
    return DiffusionRequest(prompt=f"a red fox {seed}", sampling_params=SamplingParams(
        height=size[0], width=size[1], num_inference_steps=steps, seed=seed))


#: the streaming test's requests: three sizes sharing steps in the worker process
SIZES = [(64, 64), (128, 64), (64, 128)]


ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
sys.path.insert(0, str(ENGINE_TESTS))
import engine_toy  # noqa: E402,F401  (registers "toy" here too: the engine validates requests)


def toy_req(prompt: str, steps: int = 2) -> DiffusionRequest:
    return DiffusionRequest(prompt=prompt, sampling_params=SamplingParams(
        height=16, width=16, num_inference_steps=steps, seed=0))


def make_step_engine() -> DiffusionEngine:
    """Sizes share steps whenever the key allows (``share_steps="always"``):
    the test checks what a shared step computes across processes."""
    return DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=True, max_num_seqs=4, async_output=True,
        share_steps="always"))


def test_step_mode_streams_across_processes_and_close_leaves_nothing(flux_step_engine,
                                                                     tmp_path):
    """One engine's whole life: progress streamed from a worker process, outputs
    through the arena, then close. The output arena is a memfd: it lives in the
    mappings and descriptors of this process and of the output rank, never in
    /dev/shm, and close leaves neither it nor a process behind. One request
    carries a LoRA adapter registered at run time (read in the worker process)."""
    from lora_files import make_adapter

    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES

    adapter = make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", tmp_path / "style",
                           targets=LORA_TARGET_MODULES, rank=4, seed=9)
    gc.collect()  # arenas of earlier tests still viewed by garbage go first
    held_before = arena_refs(os.getpid())
    inputs_before = arena_refs(os.getpid(), INPUT_ARENA_NAME)
    engine = make_step_engine()
    flux_step_engine.add_lora("mp-style", adapter)
    try:
        assert engine.add_lora("style", adapter).rank == 4
        pids = list(engine.executor.worker_pids)
        # where the arena lives while the engine runs: here and in the output rank
        assert arena_refs(os.getpid()) > held_before and arena_mappings(pids[0]) == 1
        assert arena_mappings(pids[0], INPUT_ARENA_NAME) == 1  # input images, by handle

        async def collect(request):
            return [o async for o in engine.step_streaming(request)]

        def styled(i: int, name: str) -> DiffusionRequest:
            r = req(i, 2 + i, SIZES[i])
            if i == 0:
                r.sampling_params.loras = {name: 1.0}
            if i == 2:  # an image-to-image request: its pixels reach the worker by handle
                r.images = [picture]
                r.sampling_params.strength = 0.75  # 3 of 4 steps
            return r

        picture = Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 128, 3),
                                                                    dtype=np.uint8))

        async def main():
            return await asyncio.gather(*(collect(styled(i, "style")) for i in range(3)))

        results = asyncio.run(main())
        assert engine.inputs is not None and engine.inputs.used_bytes == 0
        for i, outs in enumerate(results):
            assert [o.step for o in outs] == list(range(1, 3 + min(i, 1)))
            assert outs[-1].ok and outs[-1].images[0].size == SIZES[i][::-1]
            m = outs[-1].metrics
            assert m.output_wait is not None and m.postprocess_time is not None
        # the three sizes shared steps, and each is its own image alone (in-process)
        rows = engine.stats().step_batch_rows
        assert sum(rows.counts[1:]) > 0  # a step of two rows or more: two sizes
        for i, outs in enumerate(results):
            alone = flux_step_engine.generate(styled(i, "mp-style"))
            diff = np.abs(np.asarray(outs[-1].images[0]).astype(int)
                          - np.asarray(alone.images[0]).astype(int))
            assert diff.max() <= 1
        plain = flux_step_engine.generate(req(0, 2, SIZES[0]))  # the adapter moved it
        assert np.abs(np.asarray(results[0][-1].images[0]).astype(int)
                      - np.asarray(plain.images[0]).astype(int)).mean() >= 10
        assert engine.is_healthy()
        assert engine.executor.collective_rpc(CountStepStates()) == [StepStateCount(0)]
    finally:
        engine.close()
        flux_step_engine.remove_lora("mp-style")
    assert wait_until(lambda: not any(alive(p) for p in pids))
    assert not any(arena_mappings(p) for p in pids)
    assert not any(arena_mappings(p, INPUT_ARENA_NAME) for p in pids)
    gc.collect()  # a view of the arena still alive would keep its mapping
    assert wait_until(lambda: arena_refs(os.getpid(), INPUT_ARENA_NAME) <= inputs_before)
    assert wait_until(lambda: arena_refs(os.getpid()) <= held_before,
                      message=lambda: f"this process still holds {arena_refs(os.getpid())} arena refs")


def test_request_mode_error_mapping_and_worker_death():
    """The model-free toy pipeline of tests/engine, registered in the spawned
    worker through ``plugin_modules``: a failing request in a fused batch fails
    alone; a worker killed mid-forward fails its request promptly."""
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="toy", max_num_seqs=4, plugin_modules=["engine_toy"],
        worker_env={"PYTHONPATH": str(ENGINE_TESTS)}))
    try:
        outs = engine.generate([toy_req("a"), toy_req("fail"), toy_req("b")])
        assert outs[0].ok and outs[2].ok
        assert not outs[1].ok and "toy failure" in outs[1].error
        assert engine.is_healthy()
        [pid] = engine.executor.worker_pids
        victim = toy_req("block:forever")  # blocks in the worker's forward
        got: list = []
        # a hang would end at the (generous) timeout, saying so, not "died"
        t = threading.Thread(target=lambda: got.append(engine.generate(victim, timeout=300)))
        t.start()
        # admitted to a batch: its forward is running (or being sent) in the worker
        assert wait_until(lambda: engine.scheduler.num_running == 1)
        os.kill(pid, signal.SIGKILL)
        t.join(300)
        assert got[0].finished and not got[0].ok and "died" in got[0].error
        assert wait_until(lambda: not engine.is_healthy())
        with pytest.raises(EngineDeadError):
            engine.generate(toy_req("c"))
    finally:
        engine.close()



def test_the_watchdog_kills_a_hung_worker_not_a_long_forward():
    """execute_timeout_s bounds the time without progress, not a forward's
    length: a request-mode forward longer than the limit that reports its
    steps runs to its end; a worker stopped mid-forward (SIGSTOP) is declared
    hung, killed, and its request fails saying so; close() then returns (the
    error names the watchdog, so no wall-clock bound is asserted; the limit is
    7 steps' worth, so a busy machine's late heartbeat does not trip it)."""
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="toy", plugin_modules=["engine_toy"], execute_timeout_s=3.0, warmup=False,
        worker_env={"PYTHONPATH": str(ENGINE_TESTS)}))
    try:
        long = engine.generate(toy_req("slowsteps", steps=10), timeout=300)  # 4 s in all
        assert long.ok, long.error
        [pid] = engine.executor.worker_pids
        got: list = []
        t = threading.Thread(target=lambda: got.append(
            engine.generate(toy_req("slowsteps", steps=20), timeout=300)))
        t.start()
        assert wait_until(lambda: engine.scheduler.num_running == 1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)  # no more heartbeats, nor anything else
        t.join(300)
        assert got and not got[0].ok and "worker hung" in got[0].error, got
        assert "execute_timeout_s=3" in got[0].error
        assert wait_until(lambda: not engine.is_healthy())
        assert wait_until(lambda: not alive(pid))
    finally:
        closing = threading.Thread(target=engine.close)
        closing.start()
        closing.join(120)
        assert not closing.is_alive()


def test_close_returns_within_its_grace_when_a_worker_is_stopped():
    """No watchdog (execute_timeout_s=None) and a worker stopped mid-forward
    (SIGSTOP): close() still returns — the tick in flight is waited for up to
    the engine's grace, the worker up to shutdown_grace_s, then it is killed
    (SIGKILL reaches a stopped process) — the caller's request fails, and
    neither a process nor an arena mapping is left behind."""
    mapped_before = arena_mappings(os.getpid())  # other tests' engines may map theirs
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="toy", plugin_modules=["engine_toy"], execute_timeout_s=None, warmup=False,
        worker_env={"PYTHONPATH": str(ENGINE_TESTS)}, shutdown_grace_s=1.0))
    [pid] = engine.executor.worker_pids
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        engine.generate(toy_req("slowsteps", steps=50), timeout=120)))
    t.start()
    try:
        assert wait_until(lambda: engine.scheduler.num_running == 1)
        os.kill(pid, signal.SIGSTOP)
        # engine grace 5 s + worker grace 1 s + SIGTERM 2 s + SIGKILL; without
        # them close() would wait on the stopped worker for ever
        closing = threading.Thread(target=engine.close)
        closing.start()
        closing.join(120)
        assert not closing.is_alive()
        t.join(60)
        assert got and not got[0].ok and "closed" in got[0].error, got
        assert not alive(pid)
        assert arena_mappings(os.getpid()) == mapped_before
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        engine.close()


def test_restart_workers_replaces_a_dead_worker():
    """With restart_workers: the request running on a killed worker fails, a
    waiting one is served by the fresh worker, so is one submitted while it
    starts (held for it, not refused), and so is everything after."""
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="toy", plugin_modules=["engine_toy"], restart_workers=True, warmup=False,
        worker_env={"PYTHONPATH": str(ENGINE_TESTS)}))
    try:
        [pid] = engine.executor.worker_pids
        got: list = []
        running, waiting = toy_req("slowsteps", steps=20), toy_req("after")
        t = threading.Thread(target=lambda: got.extend(
            engine.generate([running, waiting], timeout=120)))
        t.start()
        assert wait_until(lambda: engine.scheduler.num_running == 1
                          and engine.scheduler.num_waiting == 1)
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not engine.is_healthy())
        assert engine.is_restarting()  # a fresh process takes seconds to start
        during = engine.generate(toy_req("during"), timeout=90)
        assert during.ok, during.error
        t.join(90)
        assert got and not got[0].ok and "workers died" in got[0].error
        assert got[1].ok, got[1].error  # it waited, then ran on the fresh worker
        assert wait_until(engine.is_healthy, timeout=60)
        [fresh] = engine.executor.worker_pids
        assert fresh != pid and not alive(pid)
        assert engine.generate(toy_req("later"), timeout=60).ok
        assert engine.stats().worker_restarts == 1
    finally:
        engine.close()


def test_a_restart_reads_the_registered_adapters_again(tmp_path):
    """Workers replaced after a crash read every registered adapter before
    they serve (their device slots start empty): a request with one gives the
    same pixels before and after."""
    from lora_files import make_adapter

    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES

    adapter = make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", tmp_path / "style",
                           targets=LORA_TARGET_MODULES, rank=4, seed=9)
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=True, restart_workers=True, warmup=False,
        lora_modules={"style": adapter}))
    try:
        styled = req(5, 2)
        styled.sampling_params.loras = {"style": 1.0}
        before = engine.generate(styled, timeout=60)
        assert before.ok, before.error
        [pid] = engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: engine.stats().worker_restarts == 1 and engine.is_healthy(),
                          timeout=90)
        again = req(5, 2)
        again.sampling_params.loras = {"style": 1.0}
        after = engine.generate(again, timeout=60)
        assert after.ok, after.error
        assert np.abs(np.asarray(after.images[0]).astype(int)
                      - np.asarray(before.images[0]).astype(int)).max() <= 1
        assert engine.stats().lora_loads_total == 2  # the slot was filled again
    finally:
        engine.close()
