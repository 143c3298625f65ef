"""What both executors share: RPC plumbing, the result pump, health.

A backend supplies how requests reach the ranks (``_broadcast``), how results
come back (``_poll_results``, raising ``WorkerDied``) and how workers stop
(``_stop_workers``). The pump thread is the sole reader of the result channel;
everything it reads goes to the ``ResultRouter``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from diffrt.runtime.executor import Executor
from diffrt.runtime.input_arena import InputArena
from diffrt.runtime.messages import (
    FreeSlots,
    InitWorker,
    Rpc,
    RpcKind,
    encode,
    encode_raw,
    result_decoder,
)
from diffrt.runtime.result_router import ResultRouter
from diffrt.runtime.shm_transport import Arena, OutputLease
from diffrt.runtime.slot_freer import SlotFreer
from diffrt.runtime.types import ExecutorConfig, ExecutorDeadError, RunnerOutput

logger = logging.getLogger(__name__)

PUMP_POLL_S = 0.05      # pump wake-up period (expiries, periodic free flush)
EXPIRE_EVERY_S = 0.1


class WorkerDied(ExecutorDeadError):
    pass


class PumpedExecutor(Executor):
    #: its ranks map the input arena (a rank on another machine cannot)
    maps_inputs = True
    def __init__(self, config: ExecutorConfig, inputs: InputArena | None = None):
        self.config = config
        self.protocol = config.runner.protocol
        self._send_lock = threading.Lock()  # every rank sees RPCs in the same order
        self._stopping = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._shut_down = False
        self.arena = Arena.create(config.max_pending_output_bytes)
        #: request inputs (images) every rank reads by handle (``input_arena``)
        #: (``inputs``: an engine's arena kept across its executors, else one of its own)
        self.inputs = None if not self.maps_inputs else (
            inputs.retain() if inputs is not None else InputArena(config.max_pending_input_bytes))
        self.router: ResultRouter  # set by _make_router once the free channel exists
        self._pump_thread: threading.Thread | None = None
        # The watchdog's view: execute calls in flight and the last sign of
        # progress (any message from a worker, or the start of a call).
        self._executing = 0
        self._last_progress = time.monotonic()
        #: every rank acknowledged its start: it reads requests (a stop, too)
        self.started = False
        self._exec_lock = threading.Lock()

    def _make_router(self, send_free: Callable[[FreeSlots], None]) -> ResultRouter:
        replies = msgspec.msgpack.Decoder(self.protocol.replies)
        return ResultRouter(self.config.world_size, self.arena, SlotFreer(send_free),
                            self.config.output_timeout_s, decode_reply=replies.decode)

    # -- backend hooks ------------------------------------------------------------
    @abstractmethod
    def _broadcast(self, data: bytes) -> None:
        """Send one encoded request to every rank, in rank order."""

    @abstractmethod
    def _poll_results(self, timeout: float) -> list[bytes]:
        """Encoded result messages available within ``timeout``; raises WorkerDied."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """Ask, then force, every worker to stop (called once, from shutdown)."""

    @abstractmethod
    def _workers_alive(self) -> bool: ...

    def _kill_workers(self) -> bool:
        """Kill every worker at once (a hang); False when this executor cannot
        (the in-process one runs its worker on a thread), which leaves
        ``execute_timeout_s`` unenforced."""
        return False

    # -- start-up -------------------------------------------------------------------
    def _init_messages(self, dist_init_method: str | None) -> tuple[int, concurrent.futures.Future, list[bytes]]:
        rpc_id, fut = self.router.new_rpc(RpcKind.COLLECTIVE)
        runner = self.config.runner
        settings = encode_raw(runner.settings)
        msgs = [encode(InitWorker(
            rank=rank, world_size=self.config.world_size, runner_cls=runner.cls,
            runner_settings=settings, async_output=self.config.async_output,
            arena_bytes=self.arena.size, output_queue_depth=self.config.output_queue_depth,
            input_arena_bytes=self.inputs.size if self.inputs is not None else 0,
            dist_init_method=dist_init_method, rpc_id=rpc_id))
            for rank in range(self.config.world_size)]
        return rpc_id, fut, msgs

    def _launch(self, send_init: Callable[[list[bytes]], None],
                dist_init_method: str | None) -> None:
        """Start the ranks: ``send_init`` delivers each rank its InitWorker
        (in rank order), then the pump runs and every rank's acknowledgement
        is awaited. Any failure shuts the executor down before it propagates."""
        try:
            rpc_id, fut, msgs = self._init_messages(dist_init_method)
            send_init(msgs)
        except BaseException:
            self.shutdown()
            raise
        self._pump_thread = threading.Thread(target=self._pump, name="diffrt-result-pump", daemon=True)
        self._pump_thread.start()
        try:
            self.router.wait_rpc(rpc_id, fut, self.config.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.started = True

    # -- the pump -------------------------------------------------------------------------
    def _pump(self) -> None:
        next_expire = 0.0
        try:
            while not self._stopping.is_set():
                for data in self._poll_results(PUMP_POLL_S):
                    self._last_progress = time.monotonic()
                    self.router.on_message(result_decoder.decode(data))
                now = time.monotonic()
                if now >= next_expire:
                    self.router.expire(now)
                    self._watch(now)
                    next_expire = now + EXPIRE_EVERY_S
        except WorkerDied as exc:
            if not self._stopping.is_set():
                logger.error("%s", exc)
                self.router.fail_all(exc)
        except BaseException as exc:  # a dead pump must never look healthy
            logger.exception("result pump died")
            self.router.fail_all(ExecutorDeadError(f"result pump died: {type(exc).__name__}: {exc}"))

    def _watch(self, now: float) -> None:
        """The hang watchdog: an execute call without progress for longer than
        ``execute_timeout_s`` kills the workers and fails everything."""
        limit = self.config.execute_timeout_s
        if limit is None or not self._executing or self.router.dead is not None:
            return
        idle = now - self._last_progress
        if idle <= limit:
            return
        if not self._kill_workers():
            return
        message = (f"worker hung: no progress for {idle:.0f} s "
                   f"(execute_timeout_s={limit:g}); its processes were killed")
        logger.error("%s", message)
        self.router.fail_all(ExecutorDeadError(message))

    # -- Executor API ------------------------------------------------------------------------
    def _call(self, kind: RpcKind, request: Any, timeout: float | None) -> Any:
        # A request the runner does not declare, or one that cannot be encoded,
        # fails here, before any bookkeeping.
        self.protocol.check_request(request)
        raw = encode_raw(request)
        rpc_id, fut = self.router.new_rpc(kind)
        try:
            with self._send_lock:
                self._broadcast(encode(Rpc(rpc_id, raw, kind)))
        except (OSError, ValueError, ExecutorDeadError) as exc:
            # The rpc is registered: fail it (and everything else) rather than leak it.
            err = ExecutorDeadError(f"cannot reach the workers: {exc}")
            self.router.fail_all(err)
            raise err from exc
        return self.router.wait_rpc(rpc_id, fut, timeout)

    def execute(self, request: Any, timeout: float | None = None) -> RunnerOutput:
        with self._exec_lock:
            self._executing += 1
            self._last_progress = time.monotonic()  # the clock starts with the call
        try:
            return self._call(RpcKind.EXECUTE, request, timeout)
        finally:
            with self._exec_lock:
                self._executing -= 1

    def collective_rpc(self, request: Any, timeout: float | None = None) -> list[Any]:
        return self._call(RpcKind.COLLECTIVE, request, timeout)

    def wait_output_ready(self, output_id: str) -> concurrent.futures.Future[OutputLease]:
        return self.router.wait_output_ready(output_id)

    def release_output(self, output_id: str) -> None:
        self.router.release_output(output_id)

    def seconds_without_progress(self) -> float:
        with self._exec_lock:
            if not self._executing:
                return 0.0
            return max(0.0, time.monotonic() - self._last_progress)

    def is_healthy(self) -> bool:
        return (not self._stopping.is_set() and self.router.dead is None
                and self._pump_thread is not None and self._pump_thread.is_alive()
                and self._workers_alive())

    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._stopping.set()
        self.router.fail_all(ExecutorDeadError("executor shut down"))
        # The pump sees _stopping within PUMP_POLL_S; join it before the workers'
        # descriptors it waits on are closed, and stop sending frees to them.
        if self._pump_thread is not None and self._pump_thread is not threading.current_thread():
            self._pump_thread.join(timeout=5.0)
        self.router.freer.closed = True
        try:
            self._stop_workers()
        finally:
            self.arena.close()
            if self.inputs is not None:
                self.inputs.close()
