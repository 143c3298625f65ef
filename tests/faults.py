"""Fault seams for tests: each wraps one runtime method for the duration of a
test (through pytest's ``monkeypatch``), so production code carries no test
branches. They act on executors running in this process (the in-process
executor's worker thread and output thread, and every executor's pump), and
on the engine's building of fresh workers for a restart."""

from __future__ import annotations

import threading
import time

import pytest

from diffrt.runtime.inproc_executor import InprocExecutor
from diffrt.runtime.messages import OutputReady
from diffrt.runtime.output_thread import OutputWriter
from diffrt.runtime.result_router import ResultRouter
from diffrt.runtime.types import ExecutorDeadError

#: how long a held output thread waits for its gate before giving up
HOLD_LIMIT_S = 30.0


def hold_outputs(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The output thread holds every batch until the returned event is set: the
    outputs are computed (COMPUTE_DONE went out) but reach the host only when
    the test says so (a slow D2H copy, without a race against a timer)."""
    gate = threading.Event()
    pack = OutputWriter._pack

    def held_pack(self, batch_id, ids, outputs, event, sync):
        deadline = time.monotonic() + HOLD_LIMIT_S
        # released by the test, or by the writer closing (executor shutdown)
        while not sync and not gate.wait(0.02) and not self._closed.is_set() \
                and time.monotonic() < deadline:
            pass
        return pack(self, batch_id, ids, outputs, event, sync)

    monkeypatch.setattr(OutputWriter, "_pack", held_pack)
    return gate


def drop_output_ready(monkeypatch: pytest.MonkeyPatch, count: int = 1) -> None:
    """The next ``count`` OUTPUT_READY messages of in-process workers are lost."""
    send = InprocExecutor._send
    left = [count]

    def lossy_send(self, msg):
        if isinstance(msg, OutputReady) and left[0] > 0:
            left[0] -= 1
            return
        send(self, msg)

    monkeypatch.setattr(InprocExecutor, "_send", lossy_send)


def crash_pump_on_output_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """The result pump raises when it routes an OUTPUT_READY (a pump bug)."""
    on_message = ResultRouter.on_message

    def failing(self, msg):
        if isinstance(msg, OutputReady):
            raise RuntimeError("injected: pump failed on output_ready")
        on_message(self, msg)

    monkeypatch.setattr(ResultRouter, "on_message", failing)


def kill_executor(executor) -> None:
    """The executor's workers are gone, as far as the engine can tell: every
    call in flight fails and ``is_healthy()`` turns False at once (what a dead
    pump or a killed worker process does, without a process to kill)."""
    executor.router.fail_all(ExecutorDeadError("injected: the workers died"))


def hold_restarts(monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> threading.Event:
    """Fresh workers for a restart start only once the returned event is set.
    Every executor an engine builds from now on waits so (``make_executor``):
    build the engine first. ``fail``: then every attempt fails, with no
    back-off between attempts, so the restart gives up at once."""
    import diffrt.engine.restart as restart_module
    import diffrt.engine.workers as workers_module

    gate = threading.Event()
    make = workers_module.make_executor

    def held_make(*args, **kwargs):
        if not gate.wait(HOLD_LIMIT_S):
            raise TimeoutError("the restart gate never opened")
        if fail:
            raise RuntimeError("injected: fresh workers failed to start")
        return make(*args, **kwargs)

    monkeypatch.setattr(workers_module, "make_executor", held_make)
    if fail:
        monkeypatch.setattr(restart_module, "RESTART_BACKOFF_S", 0.0)
    return gate
