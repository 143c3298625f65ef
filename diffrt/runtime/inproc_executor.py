"""In-process executor: the runner lives on a worker thread of this process.

Same semantics as the multiprocess executor (messages encoded with msgspec,
COMPUTE_DONE then OUTPUT_READY from the background output thread, the same
shared-memory arena, router, pump and backpressure) without spawning, so
the engine and its tests behave the same on both backends and a debugger
sees the runner. One rank only.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from diffrt.runtime.input_arena import InputArena
from diffrt.runtime.messages import FreeSlots, InitWorker, Shutdown, encode
from diffrt.runtime.pumped_executor import PumpedExecutor, WorkerDied
from diffrt.runtime.types import ExecutorConfig, ExecutorDeadError
from diffrt.runtime.worker_core import WorkerCore, serve

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


class InprocExecutor(PumpedExecutor):
    def __init__(self, config: ExecutorConfig, platform: Platform | None = None,
                 inputs: InputArena | None = None):
        if config.world_size != 1:
            raise ValueError(f"the inproc executor runs one rank; world_size={config.world_size} "
                             "needs the 'mp' backend")
        super().__init__(config, inputs)
        if platform is None:
            from diffrt.platforms import current_platform
            platform = current_platform
        self.platform: Platform = platform
        self._requests: queue.Queue[bytes] = queue.Queue()
        self._results: queue.Queue[bytes] = queue.Queue()
        self._frees: queue.Queue[FreeSlots] = queue.Queue()
        self._worker_error: BaseException | None = None
        self.core: WorkerCore | None = None  # for tests and debugging
        self.router = self._make_router(self._frees.put)
        self._worker = threading.Thread(target=self._worker_main, name="diffrt-inproc-worker0",
                                        daemon=True)
        self._launch(self._start_worker, None)

    def _start_worker(self, init_messages: list[bytes]) -> None:
        self._requests.put(init_messages[0])
        self._worker.start()

    # -- the worker thread ------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self._results.put(encode(msg))

    def _free_source(self, timeout: float) -> FreeSlots | None:
        try:
            return self._frees.get(timeout=timeout) if timeout > 0 else self._frees.get_nowait()
        except queue.Empty:
            return None

    def _build_core(self, init: InitWorker) -> WorkerCore:
        inputs = self.inputs.arena if self.inputs is not None else None
        self.core = WorkerCore(init, self.platform, self._send, self.arena, self._free_source,
                               inputs=inputs)
        return self.core

    def _worker_main(self) -> None:
        try:
            serve(self._requests.get, self._send, self._build_core)
        except BaseException as exc:  # the loop itself failed: the executor is dead
            logger.exception("inproc worker loop died")
            self._worker_error = exc

    # -- PumpedExecutor hooks ----------------------------------------------------------------
    def _broadcast(self, data: bytes) -> None:
        if not self._worker.is_alive():
            raise ExecutorDeadError("the inproc worker thread is not running")
        self._requests.put(data)

    def _poll_results(self, timeout: float) -> list[bytes]:
        try:
            out = [self._results.get(timeout=timeout)]
        except queue.Empty:
            out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        if not out and self._worker_error is not None:
            raise WorkerDied(f"inproc worker died: {self._worker_error!r}")
        return out

    def _workers_alive(self) -> bool:
        return self._worker.is_alive()

    def _stop_workers(self) -> None:
        self._requests.put(encode(Shutdown()))
        # A thread cannot be killed: a runner stuck in forward is left behind (daemon).
        self._worker.join(timeout=self.config.shutdown_grace_s)
        if self._worker.is_alive():
            logger.warning("inproc worker still busy after %.1f s; abandoning it",
                           self.config.shutdown_grace_s)


__all__ = ["InprocExecutor"]
