"""One rank's request handling, independent of how messages travel.

Used by the worker process (``worker.py``) and by the in-process executor's
worker thread, so both backends have the same semantics: every rank runs the
method; the output rank (0) sends COMPUTE_DONE as soon as forward returned and
its outputs went to the output writer; errors come back as RPC_RESULT.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from diffrt import tracing
from diffrt.runtime.messages import (
    ComputeDone,
    InitWorker,
    Rpc,
    RpcKind,
    RpcResult,
    decode_raw,
    encode_raw,
    output_ids_for,
)
from diffrt.runtime.output_thread import FreeSource, OutputWriter
from diffrt.runtime.runner import RunnerResult, resolve_runner_cls
from diffrt.runtime.shm_transport import Arena

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"


class WorkerCore:
    """Builds the runner and handles RPCs for one rank."""

    def __init__(self, init: InitWorker, platform: Any, send: Callable[[Any], None],
                 arena: Arena | None = None, free_source: FreeSource | None = None):
        self.rank = init.rank
        self.platform = platform
        self._send = send
        self._faults = dict(init.test_faults)
        self._track = f"worker{self.rank} main"
        cls = resolve_runner_cls(init.runner_cls)
        kwargs = decode_raw(init.runner_kwargs) or {}
        self.runner = cls(rank=init.rank, world_size=init.world_size, platform=platform, **kwargs)
        self.writer: OutputWriter | None = None
        if self.rank == OUTPUT_RANK:
            if arena is None or free_source is None:
                raise ValueError("the output rank needs the arena and the free channel")
            self.writer = OutputWriter(platform, arena, free_source, send, rank=self.rank,
                                       queue_depth=init.output_queue_depth,
                                       async_output=init.async_output, faults=self._faults)

    def handle(self, rpc: Rpc) -> None:
        if rpc.kind == RpcKind.COLLECTIVE:
            self._collective(rpc)
        else:
            self._execute(rpc)

    def _collective(self, rpc: Rpc) -> None:
        try:
            result = getattr(self.runner, rpc.method)(decode_raw(rpc.payload))
            self._send(RpcResult(rpc.rpc_id, self.rank, result=encode_raw(result)))
        except Exception as exc:
            self._send(RpcResult(rpc.rpc_id, self.rank, error=_error_text(exc)))

    def _execute(self, rpc: Rpc) -> None:
        start = time.monotonic_ns() / 1000.0
        keys: list[str] = []
        try:
            result = getattr(self.runner, rpc.method)(decode_raw(rpc.payload))
            if not isinstance(result, RunnerResult):
                raise TypeError(f"{type(self.runner).__name__}.{rpc.method} returned "
                                f"{type(result).__name__}, expected RunnerResult")
            keys = [str(k) for k in result.outputs]
            if self.rank != OUTPUT_RANK:
                self._send(RpcResult(rpc.rpc_id, self.rank))  # ack: this rank finished cleanly
                return
            meta = encode_raw(result.meta)
            batch_id, ids = output_ids_for(rpc.rpc_id, keys)
            outputs = {str(k): v for k, v in result.outputs.items()}
            del result
            is_async = False
            if outputs:
                assert self.writer is not None
                is_async = self.writer.submit(batch_id, ids, outputs)
            # COMPUTE_DONE right away: the next request may start while the copy runs.
            self._send(ComputeDone(rpc.rpc_id, self.rank, meta=meta,
                                   async_output_id=batch_id if is_async else None,
                                   output_ids=ids))
        except Exception as exc:
            logger.debug("rpc %d %s failed on rank %d", rpc.rpc_id, rpc.method, self.rank, exc_info=True)
            self._send(RpcResult(rpc.rpc_id, self.rank, error=_error_text(exc)))
        finally:
            tracing.record(self._track, "forward", start, time.monotonic_ns() / 1000.0,
                           method=rpc.method, keys=keys)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        close = getattr(self.runner, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                logger.warning("runner.close() failed on rank %d", self.rank, exc_info=True)
