"""The executor contract the engine codes against.

``execute`` blocks until the worker's COMPUTE_DONE and returns a ``RunnerOutput``
whose ``output_ids`` name each key's output; ``wait_output_ready`` returns a
future that resolves with an ``OutputLease`` once that key's OUTPUT_READY has
arrived (before or after the call). Control requests go through
``collective_rpc`` and never wait behind output futures. Requests and replies
are the runner's typed messages (``RunnerProtocol``).
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from typing import Any

from diffrt.runtime.input_arena import InputArena
from diffrt.runtime.shm_transport import OutputLease
from diffrt.runtime.types import RunnerOutput


class Executor(ABC):
    """Runs a runner in one or more workers; see the module docstring."""

    #: where requests' input arrays wait for the workers (``input_arena``);
    #: None: this executor carries no inputs
    inputs: InputArena | None = None

    @abstractmethod
    def execute(self, request: Any, timeout: float | None = None) -> RunnerOutput:
        """Have every rank handle ``request``; return at COMPUTE_DONE.

        Raises TypeError for a request the runner does not declare (nothing is
        sent), WorkerError when the runner raised, ExecutorDeadError when a
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
    def collective_rpc(self, request: Any, timeout: float | None = None) -> list[Any]:
        """Have every rank handle ``request``; one reply per rank."""

    @abstractmethod
    def is_healthy(self) -> bool: ...

    @abstractmethod
    def seconds_without_progress(self) -> float:
        """How long the execute call in flight has gone without a sign of
        progress (a reply, an output, a heartbeat); 0.0 while none is in
        flight. What the hang watchdog and a health check measure."""

    @abstractmethod
    def shutdown(self) -> None:
        """Fail all pending work and stop the workers (idempotent)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
