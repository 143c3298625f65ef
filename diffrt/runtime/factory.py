"""Chooses an executor backend. Nothing in the runtime imports this module:
the engine does, so the backends can import the contract without a cycle."""

from __future__ import annotations

import typing

from diffrt.runtime.executor import Executor
from diffrt.runtime.inproc_executor import InprocExecutor
from diffrt.runtime.input_arena import InputArena
from diffrt.runtime.multiproc_executor import MultiprocExecutor
from diffrt.runtime.types import ExecutorBackend, ExecutorConfig

BACKENDS: tuple[str, ...] = typing.get_args(ExecutorBackend)


def make_executor(backend: str, config: ExecutorConfig,
                  inputs: InputArena | None = None) -> Executor:
    """``"mp"`` (default: spawned worker processes), ``"inproc"`` (a worker thread
    in this process, same two-phase semantics; for debugging and tests) or
    ``"ray"`` (Ray actors in a placement group, possibly across machines;
    needs the ``ray`` extra; it carries no input images). ``inputs``: the
    input arena of an engine's earlier executor, shared with this one."""
    if backend == "ray":
        from diffrt.runtime.ray_executor import RayExecutor

        return RayExecutor(config)
    if backend == "mp":
        return MultiprocExecutor(config, inputs)
    if backend == "inproc":
        return InprocExecutor(config, inputs=inputs)
    raise ValueError(f"unknown executor backend {backend!r}; choose one of {BACKENDS}")
