"""Executor-side bookkeeping of every pending RPC and output (one per executor).

The pump thread feeds it every result message; engine threads register RPCs,
wait for outputs and release them. It guarantees what the anchor got wrong:

* OUTPUT_READY may arrive before or after COMPUTE_DONE and before or after its
  waiter: per-key ids are deterministic (``output_ids_for``), so an output is
  routed without the batch split having been registered;
* an output nobody waits for yet is kept (bounded by the arena) until claimed,
  released, or unclaimed for ``output_timeout_s``; a released or timed-out id
  is freed on arrival instead of being cached forever;
* a cancelled or timed-out waiter never raises inside the pump;
* ``fail_all`` fails every pending future at once (dead worker, dead pump,
  shutdown) and every later call fails fast.

Futures are completed outside the lock so their callbacks may call back in.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffrt.runtime.executor import (
    ExecutorDeadError,
    ExecutorError,
    OutputTimeoutError,
    RunnerOutput,
    WorkerError,
)
from diffrt.runtime.messages import (
    ComputeDone,
    FreeSlots,
    OutputReady,
    RpcKind,
    RpcResult,
    decode_raw,
)
from diffrt.runtime.shm_transport import Arena, OutputLease, read_views

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future


class SlotFreer:
    """Returns slots to the writer. ``post`` may run from a GC finalizer on any
    thread at any moment, so it only appends and never blocks on a lock."""

    def __init__(self, sink: Callable[[FreeSlots], None]):
        self._sink = sink
        self._pending: deque[tuple[int, int]] = deque()
        self._ids: deque[str] = deque()
        self._lock = threading.Lock()
        self.closed = False

    def post(self, offset: int, generation: int) -> None:
        self._pending.append((offset, generation))
        self.flush()

    def post_id(self, output_id: str) -> None:
        """Free by id (sent with the next flush; the pump flushes periodically)."""
        self._ids.append(output_id)

    def flush(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the holder (or a periodic flush) sends it
        try:
            while (self._pending or self._ids) and not self.closed:
                msg = FreeSlots(_drain(self._pending), _drain(self._ids))
                try:
                    self._sink(msg)
                except Exception:  # writer gone: nothing left to free
                    logger.debug("could not return slots", exc_info=True)
                    self.closed = True
        finally:
            self._lock.release()


def _drain(q: deque) -> list:
    out = []
    while q:
        out.append(q.popleft())
    return out


@dataclass
class _PendingRpc:
    kind: RpcKind
    future: Future
    ranks_left: int
    results: list[Any] = field(default_factory=list)


class ResultRouter:
    def __init__(self, world_size: int, arena: Arena, freer: SlotFreer, output_timeout_s: float):
        self.world_size = world_size
        self.arena = arena
        self.freer = freer
        self.output_timeout_s = output_timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._rpcs: dict[int, _PendingRpc] = {}
        self._abandoned: set[int] = set()
        self._waiters: dict[str, tuple[Future, float]] = {}      # id -> (future, deadline)
        self._arrived: dict[str, tuple[Any, float]] = {}         # id -> (lease | error, deadline)
        self._dropped: dict[str, float] = {}                     # id -> forget-after time
        self._claimed: set[str] = set()      # delivered; the lease holder frees the slot
        self._lease_done: deque[str] = deque()  # appended by lease finalizers (lock-free)
        self._dead: BaseException | None = None

    # -- state -----------------------------------------------------------------------
    @property
    def dead(self) -> BaseException | None:
        return self._dead

    def counts(self) -> dict[str, int]:
        """Sizes of the internal tables (tests assert nothing is left behind)."""
        with self._lock:
            self._forget_released_locked()
            return {"rpcs": len(self._rpcs), "waiters": len(self._waiters),
                    "arrived": len(self._arrived), "dropped": len(self._dropped),
                    "claimed": len(self._claimed)}

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(str(self._dead)) from self._dead

    # -- rpcs ------------------------------------------------------------------------
    def new_rpc(self, kind: RpcKind) -> tuple[int, Future]:
        with self._lock:
            self._check_alive()
            rpc_id = next(self._ids)
            ranks = self.world_size  # execute: COMPUTE_DONE from rank 0 + an ack per other rank
            fut: Future = Future()
            self._rpcs[rpc_id] = _PendingRpc(kind, fut, ranks, [None] * self.world_size)
            return rpc_id, fut

    def abandon_rpc(self, rpc_id: int) -> None:
        """The caller stopped waiting (timeout): free its outputs when they come."""
        with self._lock:
            if self._rpcs.pop(rpc_id, None) is not None:
                self._abandoned.add(rpc_id)

    def wait_rpc(self, rpc_id: int, fut: Future, timeout: float | None) -> Any:
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self.abandon_rpc(rpc_id)
            raise TimeoutError(f"rpc {rpc_id} did not complete within {timeout} s") from None

    # -- messages from the pump ---------------------------------------------------------
    def on_message(self, msg: Any) -> None:
        match msg:
            case ComputeDone():
                self._on_compute_done(msg)
            case OutputReady():
                self._on_output_ready(msg)
            case RpcResult():
                self._on_rpc_result(msg)
            case _:
                raise TypeError(f"unexpected result message {type(msg).__name__}")

    def _on_compute_done(self, msg: ComputeDone) -> None:
        output = RunnerOutput(meta=decode_raw(msg.meta), async_output_id=msg.async_output_id,
                              output_ids=dict(msg.output_ids))
        with self._lock:
            pending = self._rpcs.get(msg.rpc_id)
            if pending is None:
                if msg.rpc_id in self._abandoned:
                    self._abandoned.discard(msg.rpc_id)
                else:
                    logger.warning("COMPUTE_DONE for unknown rpc %d", msg.rpc_id)
                now = time.monotonic()
                for oid in msg.output_ids.values():  # nobody will ever ask for these
                    self._drop_locked(oid, now)
                return
            pending.results[msg.rank] = output
            pending.ranks_left -= 1
            if pending.ranks_left > 0:
                return  # other ranks have not acknowledged yet
            del self._rpcs[msg.rpc_id]
        _set_result(pending.future, output)

    def _on_rpc_result(self, msg: RpcResult) -> None:
        with self._lock:
            pending = self._rpcs.get(msg.rpc_id)
            if pending is None:
                if msg.rank == 0:
                    self._abandoned.discard(msg.rpc_id)
                if msg.error:
                    logger.warning("late error from rank %d for rpc %d: %s", msg.rank, msg.rpc_id, msg.error)
                return
            if msg.error is None:
                pending.results[msg.rank] = decode_raw(msg.result)
                pending.ranks_left -= 1
                if pending.ranks_left > 0:
                    return
            del self._rpcs[msg.rpc_id]
            if msg.error is not None:
                # An execute whose output rank already finished: its outputs are orphans.
                if pending.kind == RpcKind.EXECUTE and msg.rank != 0 and pending.results[0] is None:
                    self._abandoned.add(msg.rpc_id)  # rank 0's COMPUTE_DONE may still come
                now = time.monotonic()
                for r in pending.results:
                    if isinstance(r, RunnerOutput):
                        for oid in r.output_ids.values():
                            self._drop_locked(oid, now)
        if msg.error is not None:
            _set_exception(pending.future, WorkerError(f"rank {msg.rank}: {msg.error}"))
        elif pending.kind == RpcKind.COLLECTIVE:
            _set_result(pending.future, pending.results)
        else:
            _set_result(pending.future, pending.results[0])

    def _on_output_ready(self, msg: OutputReady) -> None:
        deliveries: list[tuple[str, Any]] = []
        for out in msg.outputs:
            value = read_views(self.arena, out)
            lease = OutputLease(out.output_id, value, out.nbytes,
                                _releaser(self.freer, out.slot_offset, out.generation,
                                          out.output_id, self._lease_done))
            deliveries.append((out.output_id, lease))
        for oid in msg.failed_ids:
            deliveries.append((oid, WorkerError(f"output {oid} failed: {msg.error}")))
        for oid in msg.skipped_ids:
            deliveries.append((oid, ExecutorError(f"output {oid} was released before it was packed")))
        for oid, result in deliveries:
            self._deliver(oid, result)

    def _deliver(self, oid: str, result: Any) -> None:
        with self._lock:
            if self._dropped.pop(oid, None) is not None or self._dead is not None:
                waiter = None
            else:
                waiter = self._waiters.pop(oid, None)
                if waiter is None or waiter[0].done():  # none yet, or its waiter was cancelled
                    self._arrived[oid] = (result, time.monotonic() + self.output_timeout_s)
                    return
                self._claim_locked(oid, result)
        if waiter is not None and self._hand_over(waiter[0], oid, result):
            return
        _discard(result)

    def _claim_locked(self, oid: str, result: Any) -> None:
        # In the same locked section that takes the output from the waiter or
        # arrival tables: a release_output in between must see it as claimed,
        # or it would free the slot of a lease about to be handed over.
        if isinstance(result, OutputLease):
            self._claimed.add(oid)

    def _hand_over(self, fut: Future, oid: str, result: Any) -> bool:
        """Resolve a waiter (the output already claimed); from then on the
        lease's holder owns the slot."""
        if _complete(fut, result):
            return True
        with self._lock:
            self._claimed.discard(oid)
        return False

    def _forget_released_locked(self) -> None:
        while self._lease_done:
            self._claimed.discard(self._lease_done.popleft())

    # -- outputs (engine side) -------------------------------------------------------------
    def wait_output_ready(self, oid: str) -> Future:
        with self._lock:
            if self._dead is not None:
                fut: Future = Future()
                fut.set_exception(ExecutorDeadError(str(self._dead)))
                return fut
            arrived = self._arrived.pop(oid, None)
            if arrived is not None:
                self._claim_locked(oid, arrived[0])
            else:
                existing = self._waiters.get(oid)
                if existing is not None and not existing[0].done():
                    return existing[0]  # one future per id, shared by its waiters
                fut = Future()
                self._waiters[oid] = (fut, time.monotonic() + self.output_timeout_s)
                return fut
        fut = Future()
        if not self._hand_over(fut, oid, arrived[0]):
            _discard(arrived[0])
        return fut

    def release_output(self, oid: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._forget_released_locked()
            if oid in self._claimed:
                return  # handed over: its lease holder frees it (lease.release / GC)
            arrived = self._arrived.pop(oid, None)
            waiter = self._waiters.pop(oid, None)
            if arrived is None:
                self._drop_locked(oid, now)
        if arrived is not None:
            _discard(arrived[0])
        if waiter is not None:
            waiter[0].cancel()

    def _drop_locked(self, oid: str, now: float) -> None:
        # Remembered long enough for a late arrival; then forgotten (bounded). The
        # writer frees the slot by id too, so a lost OUTPUT_READY cannot leak it.
        self._dropped[oid] = now + 2 * self.output_timeout_s + 60.0
        self.freer.post_id(oid)

    # -- housekeeping (pump calls it periodically) -------------------------------------------
    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        timed_out: list[tuple[str, Future]] = []
        stale: list[tuple[str, Any]] = []
        with self._lock:
            self._forget_released_locked()
            for oid, (fut, deadline) in list(self._waiters.items()):
                if fut.done():  # cancelled by its owner: forget the waiter, keep any output
                    del self._waiters[oid]
                elif deadline <= now:
                    del self._waiters[oid]
                    self._drop_locked(oid, now)
                    timed_out.append((oid, fut))
            for oid, (result, deadline) in list(self._arrived.items()):
                if deadline <= now:
                    del self._arrived[oid]
                    stale.append((oid, result))
            for oid, forget in list(self._dropped.items()):
                if forget <= now:
                    del self._dropped[oid]
        for oid, fut in timed_out:
            _set_exception(fut, OutputTimeoutError(
                f"output {oid} not ready within {self.output_timeout_s} s "
                "(ExecutorConfig.output_timeout_s / DIFFRT_OUTPUT_TIMEOUT_S)"))
        for oid, result in stale:
            logger.warning("output %s unclaimed for %.0f s: freed", oid, self.output_timeout_s)
            _discard(result)
        self.freer.flush()

    def fail_all(self, exc: BaseException) -> None:
        """Mark the executor dead and fail everything pending (idempotent)."""
        with self._lock:
            if self._dead is None:
                self._dead = exc
            rpcs = list(self._rpcs.values())
            waiters = [f for f, _ in self._waiters.values()]
            arrived = [r for r, _ in self._arrived.values()]
            self._rpcs.clear()
            self._waiters.clear()
            self._arrived.clear()
            self._dropped.clear()
            self._abandoned.clear()
            self._claimed.clear()
        err = ExecutorDeadError(str(exc))
        for p in rpcs:
            _set_exception(p.future, err)
        for f in waiters:
            _set_exception(f, err)
        for r in arrived:
            _discard(r)


def _releaser(freer: SlotFreer, offset: int, generation: int, oid: str,
              done: deque[str]) -> Callable[[], None]:
    # A closure over plain values: the lease's finalizer must not reference the lease.
    def release() -> None:
        freer.post(offset, generation)
        done.append(oid)
    return release


def _complete(fut: Future, result: Any) -> bool:
    """Resolve ``fut``; False when it was already cancelled/resolved (never raises)."""
    if isinstance(result, BaseException):
        return _set_exception(fut, result)
    return _set_result(fut, result)


def _set_result(fut: Future, value: Any) -> bool:
    try:
        fut.set_result(value)
        return True
    except concurrent.futures.InvalidStateError:
        return False


def _set_exception(fut: Future, exc: BaseException) -> bool:
    try:
        fut.set_exception(exc)
        return True
    except concurrent.futures.InvalidStateError:
        return False


def _discard(result: Any) -> None:
    if isinstance(result, OutputLease):
        result.release()
