"""Registering an adapter with the workers: every rank reads the file on its
loader thread (``loader.py``) while the engine goes on stepping; the caller
waits here until all ranks have it or one refused it."""

from __future__ import annotations

import time

from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.lora.loader import LOADING, READY
from diffrt.engine.runner_messages import DropLora, LoadLora, LoraState, LoraStatus
from diffrt.runtime.executor import Executor

#: how often the workers are asked how far a read got (a worker answers
#: between ticks, so a long step makes an answer later, never wrong)
POLL_S = 0.02


def load_on_workers(executor: Executor, adapter_id: int, path: str,
                    timeout_s: float) -> LoraState:
    """Have every rank read ``path`` as ``adapter_id``; what rank 0 read
    (rank, modules, bytes). ``AdapterFileError`` when a rank refused the file,
    ``TimeoutError`` after ``timeout_s`` (the workers then forget it)."""
    executor.collective_rpc(LoadLora(adapter_id, path))
    deadline = time.monotonic() + timeout_s
    while True:
        states = executor.collective_rpc(LoraStatus(adapter_id))
        failed = [s.state for s in states if s.state not in (LOADING, READY)]
        if failed:
            executor.collective_rpc(DropLora([adapter_id]))
            raise AdapterFileError(failed[0])
        if all(s.state == READY for s in states):
            return states[0]
        if time.monotonic() > deadline:
            executor.collective_rpc(DropLora([adapter_id]))
            raise TimeoutError(f"{path}: not read within lora_load_timeout_s={timeout_s:g}")
        time.sleep(POLL_S)


__all__ = ["load_on_workers"]
