"""Requests submitted while fresh workers start (``restart_workers``): held for
them and served, refused past ``restart_wait_s`` with EngineRestartingError,
EngineDeadError when the restart gives up; nothing held without restarts.

Each test has an engine of its own on the in-process executor (the toy model):
``kill_executor`` makes its workers look dead and ``hold_restarts``, installed
once the engine is built, decides when the fresh ones start (tests/faults.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_helpers import toy_engine, toy_request, wait_until
from faults import hold_restarts, kill_executor
from waiting import wait_for

from diffrt.engine import EngineDeadError, EngineRestartingError

#: generous bounds: a held request waits seconds at most in these tests
CALL_TIMEOUT_S = 30.0


def restarting_engine(**kw):
    return toy_engine(restart_workers=True, warmup=False, **kw)


def test_a_request_submitted_during_a_restart_is_served_by_the_fresh_workers(monkeypatch):
    """generate and generate_async during a restart wait (counted as waiting,
    the event loop running on) and are served by the fresh workers."""
    with restarting_engine() as engine:
        gate = hold_restarts(monkeypatch)
        old = engine.executor
        kill_executor(old)
        assert wait_until(lambda: not engine.is_healthy())
        got: list = []
        t = threading.Thread(target=lambda: got.append(
            engine.generate(toy_request(seed=3), timeout=CALL_TIMEOUT_S)))
        t.start()

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            beat = asyncio.create_task(ticker())
            held = asyncio.create_task(engine.generate_async(toy_request(seed=4)))
            await wait_for(lambda: engine.stats().requests_waiting == 2,
                           message=lambda: f"waiting: {engine.stats().requests_waiting}")
            seen = ticks
            await wait_for(lambda: ticks > seen + 5)  # the loop runs while it is held
            assert not held.done() and not engine.is_healthy()  # /health's view
            gate.set()
            out = await asyncio.wait_for(held, CALL_TIMEOUT_S)
            beat.cancel()
            return out

        async_out = asyncio.run(main())
        t.join(CALL_TIMEOUT_S)
        assert got and got[0].ok, got
        assert async_out.ok, async_out.error
        assert engine.executor is not old and engine.is_healthy()
        stats = engine.stats()
        assert stats.worker_restarts == 1 and stats.requests_total["success"] == 2


def test_past_restart_wait_s_a_held_request_is_refused_as_restarting(monkeypatch):
    """Past restart_wait_s (or its own, sooner timeout) a held request is
    refused with EngineRestartingError, an EngineDeadError, and leaves nothing
    behind; once the fresh workers serve, requests succeed again."""
    with restarting_engine(restart_wait_s=0.3) as engine:
        gate = hold_restarts(monkeypatch)
        kill_executor(engine.executor)
        with pytest.raises(EngineRestartingError,
                           match=r"restarting.*restart_wait_s=0\.3") as info:
            engine.generate(toy_request(), timeout=CALL_TIMEOUT_S)
        assert isinstance(info.value, EngineDeadError)  # callers of old keep working
        with pytest.raises(EngineRestartingError, match="its timeout"):
            engine.generate(toy_request(timeout_s=0.1), timeout=CALL_TIMEOUT_S)
        with pytest.raises(EngineRestartingError):
            asyncio.run(engine.generate_async(toy_request()))
        stats = engine.stats()
        assert stats.requests_waiting == 0 and engine.num_active_requests() == 0
        assert sum(stats.requests_total.values()) == 0  # refused, as at submission
        assert engine.is_restarting()
        gate.set()
        assert wait_until(engine.is_healthy)
        assert engine.generate(toy_request(), timeout=CALL_TIMEOUT_S).ok


def test_a_restart_that_gives_up_fails_the_held_requests_as_dead(monkeypatch):
    with restarting_engine() as engine:
        gate = hold_restarts(monkeypatch, fail=True)
        kill_executor(engine.executor)
        errors: list = []

        def submit():
            try:
                engine.generate(toy_request(), timeout=CALL_TIMEOUT_S)
            except Exception as exc:
                errors.append(exc)

        t = threading.Thread(target=submit)
        t.start()
        assert wait_until(lambda: engine.stats().requests_waiting == 1)
        gate.set()  # every attempt fails now
        t.join(CALL_TIMEOUT_S)
        [error] = errors
        assert type(error) is EngineDeadError and "restarts failed" in str(error), error
        assert not engine.is_restarting() and not engine.is_healthy()
        with pytest.raises(EngineDeadError, match="restarts failed"):
            engine.generate(toy_request())


def test_without_restart_workers_nothing_is_held():
    """restart_workers=False: a dead executor refuses at once, as before,
    whatever restart_wait_s says."""
    with toy_engine(warmup=False, restart_wait_s=30.0) as engine:
        kill_executor(engine.executor)
        assert wait_until(lambda: not engine.is_healthy())
        assert not engine.is_restarting()
        with pytest.raises(EngineDeadError) as info:
            engine.generate(toy_request(), timeout=CALL_TIMEOUT_S)
        assert not isinstance(info.value, EngineRestartingError)
        assert engine.stats().requests_waiting == 0
