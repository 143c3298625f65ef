"""diffrt runtime: two-phase async output, shared-memory transport, executors.

The runtime knows nothing of diffusion: the engine names a runner class that
lives in each worker and declares its typed messages (``types.RunnerProtocol``),
and drives it through an ``Executor`` built by ``factory.make_executor``.
This package's namespace re-exports only the leaf vocabulary (``types``), so
importing it stays cheap and no module here depends on the backends.
"""

from diffrt.runtime.types import (
    ExecutorConfig,
    ExecutorDeadError,
    ExecutorError,
    OutputTimeoutError,
    RunnerOutput,
    RunnerProtocol,
    RunnerResult,
    RunnerSpec,
    WorkerError,
)

__all__ = [
    "ExecutorConfig",
    "ExecutorDeadError",
    "ExecutorError",
    "OutputTimeoutError",
    "RunnerOutput",
    "RunnerProtocol",
    "RunnerResult",
    "RunnerSpec",
    "WorkerError",
]
