"""One rank's request handling and serve loop, independent of how messages travel.

Used by the worker process (``worker.py``) and by the in-process executor's
worker thread, so both backends run the same code: every rank handles each
request; the output rank (0) sends COMPUTE_DONE as soon as the runner returned
and its outputs went to the output writer; errors come back as RPC_RESULT.
"""

from __future__ import annotations

import importlib
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec

from diffrt import tracing
from diffrt.runtime.messages import (
    HEARTBEAT_MIN_S,
    ComputeDone,
    Heartbeat,
    InitWorker,
    Rpc,
    RpcKind,
    RpcResult,
    Shutdown,
    encode_raw,
    output_ids_for,
    request_decoder,
)
from diffrt.runtime.output_thread import FreeSource, OutputWriter
from diffrt.runtime.shm_transport import Arena
from diffrt.runtime.types import RankFailure, RunnerProtocol, RunnerResult

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0


def error_reply(rpc_id: int, rank: int, exc: BaseException) -> RpcResult:
    """An error result: one line a person can act on, and the traceback for the log."""
    message = str(exc).strip()
    line = f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__
    return RpcResult(rpc_id, rank, error=line,
                     traceback="".join(traceback.format_exception(exc)))


class Runner(Protocol):
    """What a worker calls on the runner class it builds (``runtime/types.py``
    describes the contract)."""

    protocol: ClassVar[RunnerProtocol]
    #: set by the worker before the first request; a long execute calls it
    heartbeat: Callable[[], None]
    #: set by the worker before the first request: the input arena's mapping
    #: (``input_arena``; None where the executor carries no inputs)
    inputs: Arena | None

    def __init__(self, settings: Any, *, rank: int, world_size: int,
                 platform: Platform) -> None: ...

    def handle(self, request: Any) -> Any: ...

    def close(self) -> None: ...


def resolve_runner_cls(path: str) -> type[Runner]:
    """Import ``"pkg.module:Class"`` and check it declares a RunnerProtocol."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"runner class must be 'pkg.module:Class', got {path!r}")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no runner class {attr!r}") from None
    if not isinstance(getattr(cls, "protocol", None), RunnerProtocol):
        raise TypeError(f"runner class {path} has no 'protocol' RunnerProtocol attribute")
    return cls


class WorkerCore:
    """Builds the runner and handles RPCs for one rank."""

    def __init__(self, init: InitWorker, platform: Platform, send: Callable[[Any], None],
                 arena: Arena | None = None, free_source: FreeSource | None = None, *,
                 inputs: Arena | None = None):
        self.rank = init.rank
        self.platform = platform
        self._send = send
        self._track = tracing.worker_main_track(self.rank)
        cls = resolve_runner_cls(init.runner_cls)
        protocol = cls.protocol
        self._requests = msgspec.msgpack.Decoder(protocol.requests)
        settings = msgspec.msgpack.decode(init.runner_settings, type=protocol.settings)
        self.runner = cls(settings, rank=init.rank, world_size=init.world_size, platform=platform)
        # A runner may call ``heartbeat()`` from inside a long execute (one per
        # denoise step): the executor's watchdog counts it as progress.
        self.runner.heartbeat = self._heartbeat
        # requests' input arrays arrive as handles into this shared mapping
        # (``input_arena``); a runner that takes inputs reads them there
        self.runner.inputs = inputs
        self._last_heartbeat = 0.0
        self.writer: OutputWriter | None = None
        if self.rank == OUTPUT_RANK:
            if arena is None or free_source is None:
                raise ValueError("the output rank needs the arena and the free channel")
            self.writer = OutputWriter(platform, arena, free_source, send, rank=self.rank,
                                       queue_depth=init.output_queue_depth,
                                       async_output=init.async_output)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_MIN_S:
            self._last_heartbeat = now
            self._send(Heartbeat(self.rank))

    def handle(self, rpc: Rpc) -> None:
        if rpc.kind == RpcKind.COLLECTIVE:
            self._collective(rpc)
        else:
            self._execute(rpc)

    def _collective(self, rpc: Rpc) -> None:
        try:
            reply = self.runner.handle(self._requests.decode(rpc.request))
            self._send(RpcResult(rpc.rpc_id, self.rank, reply=encode_raw(reply)))
        except Exception as exc:
            self._send(error_reply(rpc.rpc_id, self.rank, exc))

    def _execute(self, rpc: Rpc) -> None:
        start = time.monotonic_ns() / 1000.0
        keys: list[str] = []
        name = "?"
        try:
            request = self._requests.decode(rpc.request)
            name = type(request).__name__
            result = self.runner.handle(request)
            if not isinstance(result, RunnerResult):
                raise TypeError(f"{type(self.runner).__name__}.handle({name}) returned "
                                f"{type(result).__name__}, expected RunnerResult")
            keys = [str(k) for k in result.outputs]
            if self.rank != OUTPUT_RANK:
                self._send(RpcResult(rpc.rpc_id, self.rank))  # ack: this rank finished cleanly
                return
            reply = encode_raw(result.reply)
            batch_id, ids = output_ids_for(rpc.rpc_id, keys)
            outputs = {str(k): v for k, v in result.outputs.items()}
            del result
            is_async = False
            if outputs:
                assert self.writer is not None
                is_async = self.writer.submit(batch_id, ids, outputs)
            # COMPUTE_DONE right away: the next request may start while the copy runs.
            self._send(ComputeDone(rpc.rpc_id, self.rank, reply=reply,
                                   async_output_id=batch_id if is_async else None,
                                   output_ids=ids))
        except RankFailure as exc:
            logger.error("rank %d cannot go on (%s): ending it", self.rank, exc.__cause__ or exc)
            self._send(error_reply(rpc.rpc_id, self.rank, exc))
            raise
        except Exception as exc:
            logger.debug("rpc %d (%s) failed on rank %d", rpc.rpc_id, name, self.rank,
                         exc_info=True)
            self._send(error_reply(rpc.rpc_id, self.rank, exc))
        finally:
            tracing.record(self._track, tracing.FORWARD_SPAN, start,
                           time.monotonic_ns() / 1000.0, request=name, keys=keys)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        try:
            self.runner.close()
        except Exception:
            logger.warning("runner.close() failed on rank %d", self.rank, exc_info=True)


def build_core(init: InitWorker, send: Callable[[Any], None], arena: Arena | None,
               free_source: FreeSource | None, inputs: Arena | None = None) -> WorkerCore:
    """A rank's start-up wherever it runs (a spawned process, a Ray actor):
    its trace track, the process group over the platform's dist backend when
    there are several ranks, then the runner."""
    import os

    trace_dir = os.environ.get(tracing.TRACE_DIR_ENV)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        tracing.process_name(tracing.worker_process(init.rank))
    from diffrt.platforms import current_platform

    if init.dist_init_method and init.world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(backend=current_platform.distributed_backend(),
                                init_method=init.dist_init_method,
                                rank=init.rank, world_size=init.world_size)
    return WorkerCore(init, current_platform, send, arena, free_source, inputs=inputs)


def leave_process_group() -> None:
    """Undo ``build_core``'s process group, if it made one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def serve(recv: Callable[[], bytes | None], send: Callable[[Any], None],
          build: Callable[[InitWorker], WorkerCore]) -> bool:
    """The serve loop of one rank, whatever carries its messages.

    Reads ``InitWorker``, builds the core with ``build`` and acknowledges it
    (or reports the start-up error), then handles ``Rpc`` until ``Shutdown``
    or the end of the request channel (``recv`` returns None). Returns False
    when start-up failed.
    """
    data = recv()
    if data is None:
        return True
    init = request_decoder.decode(data)
    if not isinstance(init, InitWorker):
        raise TypeError(f"the first request must be InitWorker, got {type(init).__name__}")
    try:
        core = build(init)
    except Exception as exc:
        logger.debug("rank %d start-up failed", init.rank, exc_info=True)
        send(error_reply(init.rpc_id, init.rank, exc))
        return False
    send(RpcResult(init.rpc_id, init.rank))
    try:
        while (data := recv()) is not None:
            match request_decoder.decode(data):
                case Rpc() as rpc:
                    core.handle(rpc)
                case Shutdown():
                    break
                case other:
                    raise TypeError(f"unexpected request message {type(other).__name__}")
    finally:
        core.close()
    return True
