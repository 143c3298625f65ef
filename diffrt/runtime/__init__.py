"""diffrt runtime: two-phase async output, shared-memory transport, executors.

The runtime knows nothing of diffusion: the engine names a runner class that
lives in each worker (see ``runner.py``) and drives it through an ``Executor``.
"""

from diffrt.runtime.executor import (
    Executor,
    ExecutorConfig,
    ExecutorDeadError,
    ExecutorError,
    OutputTimeoutError,
    RunnerOutput,
    WorkerError,
    make_executor,
)
from diffrt.runtime.messages import AsyncOutputKind
from diffrt.runtime.runner import RunnerResult
from diffrt.runtime.shm_transport import ArenaFullError, OutputLease

__all__ = [
    "ArenaFullError",
    "AsyncOutputKind",
    "Executor",
    "ExecutorConfig",
    "ExecutorDeadError",
    "ExecutorError",
    "OutputLease",
    "OutputTimeoutError",
    "RunnerOutput",
    "RunnerResult",
    "WorkerError",
    "make_executor",
]
