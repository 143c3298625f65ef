"""Fault seams for tests: each wraps one runtime method for the duration of a
test (through pytest's ``monkeypatch``), so production code carries no test
branches. They act on executors running in this process (the in-process
executor's worker thread and output thread, and every executor's pump)."""

from __future__ import annotations

import time

import pytest

from diffrt.runtime.inproc_executor import InprocExecutor
from diffrt.runtime.messages import OutputReady
from diffrt.runtime.output_thread import OutputWriter
from diffrt.runtime.result_router import ResultRouter


def delay_outputs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The output thread waits ``seconds`` before copying each batch: outputs
    reach the host late (a slow D2H copy)."""
    pack = OutputWriter._pack

    def slow_pack(self, batch_id, ids, outputs, event, sync):
        if not sync:
            time.sleep(seconds)
        return pack(self, batch_id, ids, outputs, event, sync)

    monkeypatch.setattr(OutputWriter, "_pack", slow_pack)


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
