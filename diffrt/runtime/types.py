"""The runtime's shared vocabulary: errors, settings and the runner contract.

A leaf module: every other runtime module (and the engine) imports it, and it
imports nothing of diffrt. The runtime knows nothing of diffusion; the engine
names a runner class that lives in each worker and declares its messages in a
``RunnerProtocol``:

* the runtime constructs ``RunnerCls(settings, rank=..., world_size=...,
  platform=...)`` in every worker, ``settings`` decoded as ``protocol.settings``;
* ``Executor.execute(request)`` / ``collective_rpc(request)`` send one tagged
  msgspec Struct of ``protocol.requests``; the worker decodes it with a typed
  decoder built from that union and calls ``runner.handle(request)``, which
  dispatches with ``match``;
* ``handle`` returns a ``RunnerResult`` for an execute (its ``reply`` travels
  back with COMPUTE_DONE, its ``outputs`` through the output path) and a reply
  Struct for a collective call. Replies are decoded on the engine side as
  ``protocol.replies``;
* ``runner.close()`` is called once when the worker stops.

So a request the runner does not declare is a ``TypeError`` at the caller,
before anything is sent, never a failure inside a worker.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field
from typing import Any

import msgspec

OUTPUT_TIMEOUT_ENV = "DIFFRT_OUTPUT_TIMEOUT_S"
DEFAULT_OUTPUT_TIMEOUT_S = 600.0


# -- errors ------------------------------------------------------------------------
class ExecutorError(RuntimeError):
    """Base class of runtime errors seen by the engine."""


class WorkerError(ExecutorError):
    """The runner raised (or answered outside its protocol); the message is one
    line, the worker's traceback goes to the debug log."""


class ExecutorDeadError(ExecutorError):
    """A worker or the result pump died, or the executor was shut down."""


class RankFailure(Exception):
    """Raised by a runner whose rank cannot go on: it failed alone inside work
    its peers share, so they may be waiting in a collective it will never
    join. The rank reports the error and ends (its process exits), and the
    executor's dead-worker path fails the pending work (or the engine
    restarts its workers) rather than letting the ranks drift apart."""


class OutputTimeoutError(ExecutorError, TimeoutError):
    """OUTPUT_READY did not arrive within ``output_timeout_s``."""


# -- the runner contract ------------------------------------------------------------
@dataclass(frozen=True)
class RunnerProtocol:
    """The messages one runner class speaks.

    Args:
        settings: the Struct its constructor takes (sent once, at start-up).
        requests: a union of tagged Structs it handles.
        replies: a union of tagged Structs it answers with (execute replies and
            collective results).
    """

    settings: type
    requests: Any
    replies: Any

    def __post_init__(self) -> None:
        for name in ("requests", "replies"):
            for cls in self._members(getattr(self, name)):
                if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)
                        and cls.__struct_config__.tag is not None):
                    raise TypeError(f"RunnerProtocol.{name}: {cls!r} is not a tagged msgspec Struct")

    @staticmethod
    def _members(union: Any) -> tuple[type, ...]:
        args = typing.get_args(union)
        return args if args else (union,)

    @property
    def request_types(self) -> tuple[type, ...]:
        return self._members(self.requests)

    def check_request(self, request: Any) -> None:
        """Raise TypeError unless ``request`` is one of the declared requests."""
        if not isinstance(request, self.request_types):
            names = ", ".join(t.__name__ for t in self.request_types)
            raise TypeError(f"{type(request).__name__} is not a request of this runner "
                            f"(expected one of: {names})")


@dataclass
class RunnerSpec:
    """Which runner the workers build, with what settings.

    ``cls`` is a ``"pkg.module:Class"`` path: only the workers import it, so
    the runtime never imports the code it runs. The class carries the same
    ``protocol`` as a class attribute; the worker checks they agree.
    """

    cls: str
    protocol: RunnerProtocol
    settings: msgspec.Struct

    def __post_init__(self) -> None:
        if ":" not in self.cls:
            raise ValueError(f"runner cls must be 'pkg.module:Class', got {self.cls!r}")
        if not isinstance(self.settings, self.protocol.settings):
            raise TypeError(f"runner settings must be a {self.protocol.settings.__name__}, "
                            f"got {type(self.settings).__name__}")


@dataclass
class RunnerResult:
    """What a runner's ``handle`` returns for an execute request."""

    #: a reply Struct of the runner's protocol; travels back with COMPUTE_DONE.
    reply: Any = None
    #: key (e.g. request id) -> device tensor or nested list/dict/tuple of them;
    #: travels through the (async) output path, one ``OutputLease`` per key.
    outputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    """What ``Executor.execute`` returns at COMPUTE_DONE."""

    reply: Any                     # the runner's reply Struct (or None)
    async_output_id: str | None    # batch-level id when outputs take the async path
    output_ids: dict[str, str]     # key -> per-key id for wait_output_ready (sync path too)


# -- executor settings -----------------------------------------------------------------
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
    runner: RunnerSpec
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
    #: seconds an execute call may go without a sign of progress (a reply, an
    #: output, a heartbeat) before its workers are declared hung and killed;
    #: None: never. Only an executor that can kill its workers enforces it.
    execute_timeout_s: float | None = None
    #: extra environment for the workers (mp: spawned processes; ray: actors).
    worker_env: dict[str, str] = field(default_factory=dict)
    #: ray backend: the cluster to join when this process has not joined one
    #: (None: ``ray.init()``'s own choice, RAY_ADDRESS or a new local instance)
    ray_address: str | None = None
    #: ray backend: how outputs reach the engine: "auto" (shared memory when
    #: rank 0 shares the engine's node, else the object store), "shm", or
    #: "object_store" (forced: the cross-node path, testable on one node)
    ray_output_transport: str = "auto"
    #: ray backend: CPUs in each rank's placement-group bundle (fractional allowed)
    ray_cpus_per_rank: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.runner, RunnerSpec):
            raise TypeError(f"runner must be a RunnerSpec, got {type(self.runner).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.output_timeout_s <= 0:
            raise ValueError(f"output_timeout_s must be > 0, got {self.output_timeout_s}")
        if self.max_pending_output_bytes < 4096:
            raise ValueError(
                f"max_pending_output_bytes must be >= 4096, got {self.max_pending_output_bytes}")
        if self.execute_timeout_s is not None and not self.execute_timeout_s > 0:
            raise ValueError(f"execute_timeout_s must be > 0 or None, got {self.execute_timeout_s}")
        if self.ray_output_transport not in ("auto", "shm", "object_store"):
            raise ValueError(f"ray_output_transport must be auto, shm or object_store, "
                             f"got {self.ray_output_transport!r}")
        if not self.ray_cpus_per_rank > 0:
            raise ValueError(f"ray_cpus_per_rank must be > 0, got {self.ray_cpus_per_rank}")
        if self.output_queue_depth < 1:
            raise ValueError(f"output_queue_depth must be >= 1, got {self.output_queue_depth}")
