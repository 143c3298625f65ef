"""The executor contract the engine codes against, its config, errors and factory.

``execute`` blocks until the worker's COMPUTE_DONE and returns a ``RunnerOutput``
whose ``output_ids`` name each key's output; ``wait_output_ready`` returns a
future that resolves with an ``OutputLease`` once that key's OUTPUT_READY has
arrived (before or after the call). Control RPCs (health, sleep, profile) go
through ``collective_rpc`` and never wait behind output futures.
"""

from __future__ import annotations

import concurrent.futures
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from diffrt.runtime.shm_transport import OutputLease

OUTPUT_TIMEOUT_ENV = "DIFFRT_OUTPUT_TIMEOUT_S"
DEFAULT_OUTPUT_TIMEOUT_S = 600.0


class ExecutorError(RuntimeError):
    """Base class of runtime errors seen by the engine."""


class WorkerError(ExecutorError):
    """The runner raised; the message carries the worker's traceback."""


class ExecutorDeadError(ExecutorError):
    """A worker or the result pump died, or the executor was shut down."""


class OutputTimeoutError(ExecutorError, TimeoutError):
    """OUTPUT_READY did not arrive within ``output_timeout_s``."""


def _default_output_timeout() -> float:
    raw = os.environ.get(OUTPUT_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_OUTPUT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{OUTPUT_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{OUTPUT_TIMEOUT_ENV} must be > 0, got {value}")
    return value


@dataclass
class ExecutorConfig:
    runner_cls: str  # "pkg.module:Class", constructed in every worker
    runner_kwargs: dict[str, Any] = field(default_factory=dict)  # msgspec-encodable
    world_size: int = 1
    #: False -> outputs are copied synchronously on the worker's main thread.
    async_output: bool = True
    #: seconds a ``wait_output_ready`` future (and an unclaimed output) may wait.
    output_timeout_s: float = field(default_factory=_default_output_timeout)
    #: size of the shared-memory output arena: pending outputs beyond it throttle
    #: the worker. Virtual until touched (pages are reused lowest-first).
    max_pending_output_bytes: int = 2 << 30
    #: outputs handed to the output thread but not yet copied (device memory bound).
    output_queue_depth: int = 2
    #: seconds to wait for workers to import and construct their runner.
    startup_timeout_s: float = 300.0
    #: seconds shutdown waits for a polite exit before terminate, then kill.
    shutdown_grace_s: float = 5.0
    #: extra environment for spawned workers (mp backend).
    worker_env: dict[str, str] = field(default_factory=dict)
    #: TEST ONLY fault injection, see ``diffrt.runtime.faults``. Never set in production.
    _test_faults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if ":" not in self.runner_cls:
            raise ValueError(f"runner_cls must be 'pkg.module:Class', got {self.runner_cls!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.output_timeout_s <= 0:
            raise ValueError(f"output_timeout_s must be > 0, got {self.output_timeout_s}")
        if self.max_pending_output_bytes < 4096:
            raise ValueError(
                f"max_pending_output_bytes must be >= 4096, got {self.max_pending_output_bytes}")
        if self.output_queue_depth < 1:
            raise ValueError(f"output_queue_depth must be >= 1, got {self.output_queue_depth}")


@dataclass
class RunnerOutput:
    meta: Any                      # RunnerResult.meta as builtins
    async_output_id: str | None    # batch-level id when outputs take the async path
    output_ids: dict[str, str]     # key -> per-key id for wait_output_ready (sync path too)


class Executor(ABC):
    """Runs a runner in one or more workers; see the module docstring."""

    @abstractmethod
    def execute(self, method: str, payload: Any = None, timeout: float | None = None) -> RunnerOutput:
        """Run ``runner.<method>(payload)`` on every rank; return at COMPUTE_DONE.

        Raises WorkerError when the runner raised, ExecutorDeadError when a
        worker or the pump died or the executor is shut down, TimeoutError
        after ``timeout`` seconds (the late outputs are then freed on arrival).
        """

    @abstractmethod
    def wait_output_ready(self, output_id: str) -> concurrent.futures.Future[OutputLease]:
        """Future of one key's output; OutputTimeoutError after output_timeout_s."""

    @abstractmethod
    def release_output(self, output_id: str) -> None:
        """The engine will never read this output: free it now or on arrival."""

    @abstractmethod
    def collective_rpc(self, method: str, payload: Any = None, timeout: float | None = None) -> list[Any]:
        """Call ``runner.<method>(payload)`` on every rank; one result per rank."""

    @abstractmethod
    def is_healthy(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Fail all pending work and stop the workers (idempotent)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def make_executor(backend: str, config: ExecutorConfig) -> Executor:
    """``"mp"`` (default: spawned worker processes) or ``"inproc"`` (a worker thread
    in this process, same two-phase semantics; for debugging and tests)."""
    if backend == "mp":
        from diffrt.runtime.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "inproc":
        from diffrt.runtime.inproc_executor import InprocExecutor

        return InprocExecutor(config)
    raise ValueError(f"unknown executor backend {backend!r}; choose 'mp' or 'inproc'")
