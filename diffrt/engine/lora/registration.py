"""Registering an adapter with the workers: every rank reads the file on its
loader thread (``loader.py``) while the engine goes on stepping; the caller
waits here until all ranks have it or one refused it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.lora.loader import LOADING, READY
from diffrt.engine.lora.registry import Adapter, AdapterRegistry, LoraInfo
from diffrt.engine.runner_messages import AdapterState, AdapterStatus, DropAdapters, LoadAdapter
from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)

#: how often the workers are asked how far a read got (a worker answers
#: between ticks, so a long step makes an answer later, never wrong)
POLL_S = 0.02


def load_on_workers(executor: Executor, adapter_id: int, path: str,
                    timeout_s: float) -> AdapterState:
    """Have every rank read ``path`` as ``adapter_id``; what rank 0 read
    (rank, modules, bytes). ``AdapterFileError`` when a rank refused the file,
    ``TimeoutError`` after ``timeout_s`` (the workers then forget it)."""
    executor.collective_rpc(LoadAdapter(adapter_id, path))
    deadline = time.monotonic() + timeout_s
    while True:
        states = executor.collective_rpc(AdapterStatus(adapter_id))
        failed = [s.state for s in states if s.state not in (LOADING, READY)]
        if failed:
            executor.collective_rpc(DropAdapters([adapter_id]))
            raise AdapterFileError(failed[0])
        if all(s.state == READY for s in states):
            return states[0]
        if time.monotonic() > deadline:
            executor.collective_rpc(DropAdapters([adapter_id]))
            raise TimeoutError(f"{path}: not read within lora_load_timeout_s={timeout_s:g}")
        time.sleep(POLL_S)


def _read(registry: AdapterRegistry, executor: Executor, adapter: Adapter,
          timeout_s: float) -> AdapterState:
    """The workers read ``adapter``'s file; a failure gives its name back."""
    try:
        state = load_on_workers(executor, adapter.id, adapter.path, timeout_s)
    except BaseException:
        registry.abandon(adapter)
        raise
    adapter.rank, adapter.modules, adapter.nbytes = state.rank, state.modules, state.nbytes
    return state


def register(registry: AdapterRegistry, executor_now: Callable[[], Executor], name: str,
             path: str, timeout_s: float) -> LoraInfo:
    """``DiffusionEngine.add_lora``: reserve ``name``, have the workers read
    the file, confirm it; fresh workers that started meanwhile
    (``executor_now()`` another executor) read it too."""
    adapter = registry.reserve(name, os.path.abspath(path))
    executor = executor_now()
    state = _read(registry, executor, adapter, timeout_s)
    registry.confirm(adapter)
    if executor_now() is not executor:  # fresh workers started meanwhile: they read it too
        try:
            load_on_workers(executor_now(), adapter.id, adapter.path, timeout_s)
        except Exception as exc:
            registry.lost(adapter.id)
            raise AdapterFileError(f"{adapter.path}: the restarted workers could not read "
                                   f"it: {exc}") from exc
    logger.info("LoRA adapter %r registered: %s (rank %d, %d layers, %d KiB)", name,
                adapter.path, state.rank, state.modules, state.nbytes >> 10)
    return next(info for info in registry.infos() if info.name == name)


def update(registry: AdapterRegistry, executor_now: Callable[[], Executor], name: str,
           path: str, version: int | str, timeout_s: float) -> LoraInfo:
    """``DiffusionEngine.update_lora``: the workers read the new factors as
    a new adapter, which then takes the name (``AdapterRegistry.swap``);
    the old one leaves the workers when the last request holding it ends."""
    adapter = registry.reserve_update(name, os.path.abspath(path))
    adapter.version = version
    executor = executor_now()
    _read(registry, executor, adapter, timeout_s)
    ids = registry.swap(adapter)
    if ids:
        executor.collective_rpc(DropAdapters(ids))
    logger.info("LoRA adapter %r updated to version %r", name, version)
    return next(info for info in registry.infos() if info.name == name)


def unregister(registry: AdapterRegistry, executor: Executor, name: str) -> None:
    """``DiffusionEngine.remove_lora``: refuse ``name`` from now on; the
    workers drop its weights now if no request holds it."""
    ids = registry.remove(name)
    logger.info("LoRA adapter %r removed", name)
    if ids:
        try:
            executor.collective_rpc(DropAdapters(ids))
        except Exception as exc:  # removed all the same: workers gone hold nothing
            logger.warning("dropping LoRA adapter %r in the workers failed: %s", name, exc)


__all__ = ["load_on_workers", "register", "unregister", "update"]
