"""The runtime's shared vocabulary: errors, settings and the runner contract.

A leaf module: every other runtime module (and the engine) imports it, and it
imports nothing of diffrt but the leaf ``diffrt.field_error`` (the base of its
``DeclaredValueError``). The runtime knows nothing of diffusion; the engine
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

import math
import os
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from diffrt.field_error import FieldError

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

    settings: type[msgspec.Struct]
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


def check_declared(struct: msgspec.Struct, fields: tuple[str, ...] | None = None) -> None:
    """Check ``struct``'s fields (or ``fields`` of them) against the
    constraints their declarations carry (``msgspec.Meta``: ranges, lengths,
    choices). msgspec checks them when it decodes, not when a Struct is built
    in Python; this runs the same decode on the values as given.

    Raises:
        DeclaredValueError: naming the first field that breaks its declaration.
    """
    names = fields if fields is not None else struct.__struct_fields__
    values = {name: getattr(struct, name) for name in names}
    cls = type(struct) if fields is None else _subset(type(struct), names)
    _check_finite(values)
    try:
        msgspec.convert(values, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise DeclaredValueError.from_validation(exc, values, cls) from None


def _check_finite(values: dict[str, Any]) -> None:
    """No declared number is infinite or NaN: a limit of ``inf`` seconds
    reaches ``threading`` and ``queue`` calls that refuse it."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise DeclaredValueError(name, f"must be a finite number, got {value!r}")


def convert_declared(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` checked against its declarations and normalised as
    a decode would (a list for a tuple field becomes a tuple, an int for a
    float field a float).

    Raises:
        DeclaredValueError: naming the first field that breaks its declaration.
    """
    _check_finite(values)
    try:
        return msgspec.convert(values, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise DeclaredValueError.from_validation(exc, values, cls) from None


def _subset(cls: type, names: tuple[str, ...]) -> type:
    """A Struct of ``names`` of ``cls``'s fields, declarations and defaults kept."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return msgspec.defstruct(f"{cls.__name__}Subset", [(n, hints[n]) for n in names],
                             kw_only=True)


class DeclaredValueError(FieldError):
    """A value that breaks its field's declaration; ``field`` names the field."""

    @classmethod
    def from_validation(cls, exc: msgspec.ValidationError, values: dict[str, Any],
                        struct: type) -> DeclaredValueError:
        """msgspec's "Expected `int` >= 1 - at `$.name`" as "name: must be an
        int >= 1, got 0" (a choice lists the values allowed)."""
        # a mapping's key: "... - at `key` in `$.name`"
        text = str(exc).replace(" - at `key` in `$.", " (a key) - at `$.")
        message, _, where = text.rpartition(" - at `$.")
        if not where:  # not about one field
            return cls("value", str(exc))
        field = where.rstrip("`").split(".")[0].split("[")[0]
        choices = _choices(struct, field)
        if choices is not None:
            allowed = ", ".join(repr(c) for c in choices)
            return cls(field, f"must be one of {allowed}, got {short_repr(values.get(field))}")
        message = message.split(", got `")[0].replace("Expected ", "").replace("`", "")
        message = message.replace(" | ", "|")
        kind, _, bound = message.partition(" ")
        words = " or ".join(_WORDS.get(part, part) for part in kind.split("|"))
        return cls(field, f"must be {words}{' ' + bound if bound else ''}, "
                          f"got {short_repr(values.get(field))}")


#: msgspec's type names in a user's words
_WORDS = {"int": "an int", "float": "a number", "str": "a str", "bool": "a bool",
          "array": "a sequence", "object": "a mapping", "null": "None"}


#: the most characters of a client's value an error message quotes
SHORT_CHARS = 80


def short_repr(value: Any, limit: int = SHORT_CHARS) -> str:
    """``value``'s repr as an error quotes it: cut to ``limit`` characters
    (ending "...") so a megabyte-long value is not echoed back whole."""
    return cut(repr(value), limit)


def cut(text: str, limit: int = SHORT_CHARS) -> str:
    """``text`` cut to ``limit`` characters, ending "..." when it was longer."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _choices(struct: type, field: str) -> tuple[Any, ...] | None:
    """The values a Literal field allows (None for any other field)."""
    info = msgspec.inspect.type_info(struct)
    for f in getattr(info, "fields", ()):
        if f.name == field:
            return _literal_values(f.type)
    return None


def _literal_values(t: Any) -> tuple[Any, ...] | None:
    if isinstance(t, msgspec.inspect.Metadata):
        return _literal_values(t.type)
    if isinstance(t, msgspec.inspect.LiteralType):
        return tuple(t.values)
    if isinstance(t, msgspec.inspect.UnionType):
        for member in t.types:
            values = _literal_values(member)
            if values is not None:
                return values
    return None


#: where an engine's ranks run: worker processes, a thread of this process, Ray actors
ExecutorBackend = typing.Literal["mp", "inproc", "ray"]
#: how an executor's outputs travel from a Ray rank 0 to the engine
RayOutputTransport = typing.Literal["auto", "shm", "object_store"]


class ExecutorOptions(msgspec.Struct, kw_only=True, frozen=True):
    """The executor's tuning, declared once: ``ExecutorConfig`` carries these
    fields, and the engine's executor settings are this same declaration (an
    ``EngineConfig`` keyword for each). Frozen, as the engine's settings that
    extend it are: nothing changes an executor's options once it is made."""

    #: seconds a ``wait_output_ready`` future (and an unclaimed output) may wait
    output_timeout_s: Annotated[float, msgspec.Meta(gt=0, description=(
        "seconds to wait for an output once its compute is done (default: "
        "$DIFFRT_OUTPUT_TIMEOUT_S, else 600)"))] = msgspec.field(
        default_factory=_default_output_timeout)
    max_pending_output_bytes: Annotated[int, msgspec.Meta(ge=4096, description=(
        "bound on the bytes of finished outputs no consumer has taken yet, wherever they "
        "sit (the shared-memory arena's size; virtual until touched); at the bound the "
        "worker waits: nothing is dropped"))] = 2 << 30
    max_pending_input_bytes: Annotated[int, msgspec.Meta(ge=4096, description=(
        "bound on the bytes of input images of the requests the engine holds (the input "
        "arena's size, shared memory every worker maps; virtual until touched); a "
        "request whose inputs do not fit is refused"))] = 512 << 20
    output_queue_depth: Annotated[int, msgspec.Meta(ge=1, description=(
        "outputs handed to a worker's output thread but not yet copied (bounds device "
        "memory held by outputs)"))] = 2
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0, description=(
        "seconds each worker may take to import and load the model (a multi-GB "
        "checkpoint takes minutes)"))] = 300.0
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, description=(
        "seconds shutdown waits for a polite worker exit before terminate, then kill"))] = 5.0
    execute_timeout_s: Annotated[Annotated[float, msgspec.Meta(gt=0)] | None, msgspec.Meta(
        description=("seconds an execute call may go without a sign of progress (a reply, "
                     "an output, a per-step heartbeat) before its workers are declared hung "
                     "and killed; None: never. Only an executor that can kill its workers "
                     "enforces it"))] = 300.0
    worker_env: Annotated[dict[str, str], msgspec.Meta(description=(
        "extra environment of the workers (KEY=VALUE; mp: spawned processes, ray: "
        "actors)"))] = msgspec.field(default_factory=dict)
    ray_address: Annotated[str | None, msgspec.Meta(description=(
        "ray backend: the cluster to join when this process has joined none (None: "
        "ray.init()'s own choice, $RAY_ADDRESS or a new local instance)"))] = None
    ray_output_transport: Annotated[RayOutputTransport, msgspec.Meta(description=(
        "ray backend: how outputs reach the engine: auto (shared memory when rank 0 "
        "shares the engine's node, else the object store), shm, or object_store"))] = "auto"
    ray_cpus_per_rank: Annotated[float, msgspec.Meta(gt=0, description=(
        "ray backend: CPUs in each rank's placement-group bundle (fractions allowed)"))] = 1.0


class ExecutorConfig(ExecutorOptions, kw_only=True, frozen=True):
    """What an executor runs (``runner``, on ``world_size`` ranks) and how."""

    runner: Any
    world_size: int = 1
    #: False -> outputs are copied synchronously on the worker's main thread.
    async_output: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.runner, RunnerSpec):
            raise TypeError(f"runner must be a RunnerSpec, got {type(self.runner).__name__}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        check_declared(self, ExecutorOptions.__struct_fields__)
