"""Executor-side bookkeeping of every pending RPC and output (one per executor).

The pump thread feeds it every result message; engine threads register RPCs,
wait for outputs and release them. Every output id has one entry in one table,
in one ``OutputState``, and changes state only in ``_transition``; the table
below is the whole lifecycle (``-`` = no entry):

    state     WAIT             ARRIVE              RELEASE         EXPIRE (expired)
    -         WAITING          ARRIVED             DROPPED         -
    WAITING   (same future)    CLAIMED, hand over  DROPPED, cancel DROPPED, time out
    ARRIVED   CLAIMED, hand    (duplicate freed)   -, free         -, free
    CLAIMED   error            (duplicate freed)   (holder frees)  (LEASE_DONE: -)
    DROPPED   error            -, free             (nothing)       -

PENDING (OutputPending, repeated while an output waits for room in a full
arena) puts an output nobody waits for yet in BLOCKED and restarts the expiry
of a BLOCKED or WAITING one: a slow consumer elsewhere is not a lost output.
WAIT on BLOCKED becomes WAITING; ARRIVE and RELEASE treat BLOCKED as no entry;
a BLOCKED entry without notices is forgotten when it expires.

It guarantees:

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
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from diffrt.runtime.futures import complete, set_exception
from diffrt.runtime.messages import (
    NIL,
    PENDING_NOTICE_S,
    ComputeDone,
    Heartbeat,
    OutputPending,
    OutputReady,
    RpcKind,
    RpcResult,
)
from diffrt.runtime.shm_transport import Arena, OutputLease, read_views
from diffrt.runtime.slot_freer import SlotFreer, releaser
from diffrt.runtime.types import (
    ExecutorDeadError,
    ExecutorError,
    OutputTimeoutError,
    RunnerOutput,
    WorkerError,
)

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future


@dataclass
class _PendingRpc:
    kind: RpcKind
    future: Future
    ranks_left: int
    results: list[Any] = field(default_factory=list)


class OutputState(enum.Enum):
    """Where one output id stands, from the router's point of view."""

    BLOCKED = "blocked"   # computed, waits for arena room; nobody has asked yet
    WAITING = "waiting"   # the engine waits for it; not arrived yet
    ARRIVED = "arrived"   # in shared memory (or failed); nobody has asked yet
    CLAIMED = "claimed"   # handed over: the lease holder frees the slot
    DROPPED = "dropped"   # released or timed out before arriving: free it on arrival


class OutputEvent(enum.Enum):
    WAIT = "wait"                  # the engine asks for the output
    ARRIVE = "arrive"              # OUTPUT_READY (or its failure) came in
    RELEASE = "release"            # the engine will never read it
    HANDOVER_FAILED = "handover_failed"  # the waiter was cancelled while handing over
    PENDING = "pending"            # computed, waiting for arena room: the wait goes on
    LEASE_DONE = "lease_done"      # the lease holder released the slot
    EXPIRE = "expire"              # periodic housekeeping at ``now``


@dataclass
class _Output:
    state: OutputState
    #: WAITING: when the waiter times out; ARRIVED: when an unclaimed output is
    #: freed; DROPPED: when the id is forgotten (a late arrival is still freed).
    expires_at: float
    future: Future | None = None   # WAITING
    result: Any = None             # ARRIVED: an OutputLease or an exception

    @property
    def waiter(self) -> Future:
        """A WAITING output's future (every WAITING ``_Output`` is made with one)."""
        assert self.future is not None
        return self.future


@dataclass
class _Effects:
    """What a transition asks to happen once the lock is released (futures run
    callbacks that may call back into the router)."""

    resolve: list[tuple[Future, Any]] = field(default_factory=list)
    cancel: list[Future] = field(default_factory=list)
    discard: list[Any] = field(default_factory=list)
    #: (output id, future, result): hand an arrived output to its waiter.
    hand_over: list[tuple[str, Future, Any]] = field(default_factory=list)


class ResultRouter:
    def __init__(self, world_size: int, arena: Arena, freer: SlotFreer, output_timeout_s: float,
                 decode_reply: Callable[[msgspec.Raw], Any] = msgspec.msgpack.decode):
        self.world_size = world_size
        self.arena = arena
        self.freer = freer
        self.output_timeout_s = output_timeout_s
        self._decode_reply = decode_reply
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._rpcs: dict[int, _PendingRpc] = {}
        self._abandoned: set[int] = set()    # rpcs whose caller stopped waiting
        self._outputs: dict[str, _Output] = {}
        self._lease_done: deque[str] = deque()  # appended by lease finalizers (lock-free)
        self._dead: BaseException | None = None

    # -- state -----------------------------------------------------------------------
    @property
    def dead(self) -> BaseException | None:
        return self._dead

    def counts(self) -> dict[str, int]:
        """Pending rpcs and outputs per state (tests assert nothing is left behind)."""
        with self._lock:
            self._forget_released_locked()
            counts = {"rpcs": len(self._rpcs)}
            counts.update({state.value: 0 for state in OutputState})
            for entry in self._outputs.values():
                counts[entry.state.value] += 1
            return counts

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(str(self._dead)) from self._dead

    # -- the output state machine ------------------------------------------------------
    def _transition(self, oid: str, event: OutputEvent, fx: _Effects, *, now: float,
                    result: Any = None, future: Future | None = None) -> None:
        """The one place an output changes state (called with the lock held)."""
        entry = self._outputs.get(oid)
        S, E = OutputState, OutputEvent
        match event, entry:
            case E.WAIT, None:
                assert future is not None
                self._outputs[oid] = _Output(S.WAITING, now + self.output_timeout_s, future=future)
            case E.WAIT, _Output(state=S.BLOCKED):
                assert future is not None
                self._outputs[oid] = _Output(S.WAITING, max(entry.expires_at, now + self.output_timeout_s),
                                             future=future)
            case E.WAIT, _Output(state=S.ARRIVED):
                assert future is not None
                self._claim_locked(oid, entry.result)
                fx.hand_over.append((oid, future, entry.result))
            case E.WAIT, _Output(state=S.CLAIMED | S.DROPPED):
                assert future is not None
                fx.resolve.append((future, ExecutorError(
                    f"output {oid} was already {entry.state.value}")))
            case E.ARRIVE, None | _Output(state=S.BLOCKED):
                self._outputs[oid] = _Output(S.ARRIVED, now + self.output_timeout_s, result=result)
            case E.ARRIVE, _Output(state=S.WAITING):
                if entry.waiter.done():  # its waiter was cancelled: keep it for another
                    self._outputs[oid] = _Output(S.ARRIVED, now + self.output_timeout_s,
                                                 result=result)
                else:
                    self._claim_locked(oid, result)
                    fx.hand_over.append((oid, entry.waiter, result))
            case E.ARRIVE, _Output(state=S.DROPPED):
                del self._outputs[oid]
                fx.discard.append(result)
            case E.ARRIVE, _:  # a duplicate: the first one wins
                fx.discard.append(result)
            case E.RELEASE, None | _Output(state=S.BLOCKED):
                self._drop_locked(oid, now)
            case E.RELEASE, _Output(state=S.WAITING):
                fx.cancel.append(entry.waiter)
                self._drop_locked(oid, now)
            case E.RELEASE, _Output(state=S.ARRIVED):
                del self._outputs[oid]
                fx.discard.append(entry.result)
            case E.RELEASE, _:
                pass  # claimed: its lease holder frees it; dropped: already on its way
            # notices repeat every PENDING_NOTICE_S
            case E.PENDING, None | _Output(state=S.BLOCKED | S.WAITING):
                expires_at = now + max(self.output_timeout_s, 3 * PENDING_NOTICE_S)
                if entry is None:
                    self._outputs[oid] = _Output(S.BLOCKED, expires_at)
                else:
                    entry.expires_at = expires_at
            case E.HANDOVER_FAILED | E.LEASE_DONE, _Output(state=S.CLAIMED):
                del self._outputs[oid]
            case E.EXPIRE, _Output(state=S.WAITING) if entry.waiter.done():
                del self._outputs[oid]  # cancelled by its owner and never arrived
            case E.EXPIRE, _Output(state=S.WAITING) if entry.expires_at <= now:
                self._drop_locked(oid, now)
                fx.resolve.append((entry.waiter, OutputTimeoutError(
                    f"output {oid} not ready within {self.output_timeout_s} s "
                    "(ExecutorConfig.output_timeout_s / DIFFRT_OUTPUT_TIMEOUT_S)")))
            case E.EXPIRE, _Output(state=S.ARRIVED) if entry.expires_at <= now:
                logger.warning("output %s unclaimed for %.0f s: freed", oid, self.output_timeout_s)
                del self._outputs[oid]
                fx.discard.append(entry.result)
            case E.EXPIRE, _Output(state=S.DROPPED | S.BLOCKED) if entry.expires_at <= now:
                del self._outputs[oid]  # BLOCKED: no notice for a while, the writer moved on
            case _:
                pass

    def _claim_locked(self, oid: str, result: Any) -> None:
        # In the same locked section that takes the output: a release_output
        # racing with the hand-over must see it claimed, or it would free the
        # slot of a lease about to be handed over. An error has no slot.
        if isinstance(result, OutputLease):
            self._outputs[oid] = _Output(OutputState.CLAIMED, 0.0)
        else:
            self._outputs.pop(oid, None)

    def _drop_locked(self, oid: str, now: float) -> None:
        # Remembered long enough for a late arrival; then forgotten (bounded). The
        # writer frees the slot by id too, so a lost OUTPUT_READY cannot leak it.
        self._outputs[oid] = _Output(OutputState.DROPPED, now + 2 * self.output_timeout_s + 60.0)
        self.freer.post_id(oid)

    def _forget_released_locked(self) -> None:
        fx = _Effects()
        while self._lease_done:
            self._transition(self._lease_done.popleft(), OutputEvent.LEASE_DONE, fx, now=0.0)

    def _run(self, fx: _Effects) -> None:
        """Carry out a transition's effects, outside the lock."""
        for fut, value in fx.resolve:
            complete(fut, value)
        for fut in fx.cancel:
            fut.cancel()
        for result in fx.discard:
            _discard(result)
        for oid, fut, result in fx.hand_over:
            if complete(fut, result):
                continue  # from then on the lease's holder owns the slot
            with self._lock:
                self._transition(oid, OutputEvent.HANDOVER_FAILED, _Effects(), now=0.0)
            _discard(result)

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
            case Heartbeat():
                pass  # a sign of life: the pump noted it
            case OutputPending():
                with self._lock:
                    now = time.monotonic()
                    for oid in msg.output_ids:
                        self._transition(oid, OutputEvent.PENDING, _Effects(), now=now)
            case _:
                raise TypeError(f"unexpected result message {type(msg).__name__}")

    def _reply(self, raw: msgspec.Raw) -> Any:
        return None if bytes(raw) == bytes(NIL) else self._decode_reply(raw)

    def _on_compute_done(self, msg: ComputeDone) -> None:
        try:
            reply = self._reply(msg.reply)
        except Exception as exc:  # the runner answered outside its protocol: fail that call
            self._on_rpc_result(RpcResult(msg.rpc_id, msg.rank, error=_undeclared(exc)))
            with self._lock:  # nobody will read its outputs: freed on arrival
                now = time.monotonic()
                for oid in msg.output_ids.values():
                    self._transition(oid, OutputEvent.RELEASE, _Effects(), now=now)
            return
        output = RunnerOutput(reply=reply, async_output_id=msg.async_output_id,
                              output_ids=dict(msg.output_ids))
        fx = _Effects()
        with self._lock:
            pending = self._rpcs.get(msg.rpc_id)
            if pending is None:
                if msg.rpc_id in self._abandoned:
                    self._abandoned.discard(msg.rpc_id)
                else:
                    logger.warning("COMPUTE_DONE for unknown rpc %d", msg.rpc_id)
                now = time.monotonic()
                for oid in msg.output_ids.values():  # nobody will ever ask for these
                    self._transition(oid, OutputEvent.RELEASE, fx, now=now)
            else:
                pending.results[msg.rank] = output
                pending.ranks_left -= 1
                if pending.ranks_left > 0:
                    return  # other ranks have not acknowledged yet
                del self._rpcs[msg.rpc_id]
                fx.resolve.append((pending.future, output))
        self._run(fx)

    def _on_rpc_result(self, msg: RpcResult) -> None:
        if msg.traceback:
            logger.debug("rank %d, rpc %d failed:\n%s", msg.rank, msg.rpc_id, msg.traceback)
        fx = _Effects()
        with self._lock:
            pending = self._rpcs.get(msg.rpc_id)
            if pending is None:
                if msg.rank == 0:
                    self._abandoned.discard(msg.rpc_id)
                if msg.error:
                    logger.warning("late error from rank %d for rpc %d: %s", msg.rank, msg.rpc_id, msg.error)
                return
            if msg.error is None:
                try:
                    pending.results[msg.rank] = self._reply(msg.reply)
                except Exception as exc:  # outside the runner's protocol: fail that call
                    msg = RpcResult(msg.rpc_id, msg.rank, error=_undeclared(exc))
            if msg.error is None:
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
                            self._transition(oid, OutputEvent.RELEASE, fx, now=now)
                fx.resolve.append((pending.future, WorkerError(f"rank {msg.rank}: {msg.error}")))
            elif pending.kind == RpcKind.COLLECTIVE:
                fx.resolve.append((pending.future, pending.results))
            else:
                fx.resolve.append((pending.future, pending.results[0]))
        self._run(fx)

    def _on_output_ready(self, msg: OutputReady) -> None:
        arrivals: list[tuple[str, Any]] = []
        for out in msg.outputs:
            value = read_views(self.arena, out)
            lease = OutputLease(out.output_id, value, out.nbytes,
                                releaser(self.freer, out.slot_offset, out.generation,
                                          out.output_id, self._lease_done))
            arrivals.append((out.output_id, lease))
        for oid in msg.failed_ids:
            arrivals.append((oid, WorkerError(f"output {oid} failed: {msg.error}")))
        for oid in msg.skipped_ids:
            arrivals.append((oid, ExecutorError(f"output {oid} was released before it was packed")))
        fx = _Effects()
        now = time.monotonic()
        with self._lock:
            for oid, result in arrivals:
                if self._dead is not None:
                    fx.discard.append(result)
                else:
                    self._transition(oid, OutputEvent.ARRIVE, fx, now=now, result=result)
        self._run(fx)

    # -- outputs (engine side) -------------------------------------------------------------
    def wait_output_ready(self, oid: str) -> Future:
        fx = _Effects()
        with self._lock:
            if self._dead is not None:
                fut: Future = Future()
                fut.set_exception(ExecutorDeadError(str(self._dead)))
                return fut
            self._forget_released_locked()
            entry = self._outputs.get(oid)
            if entry is not None and entry.state is OutputState.WAITING:
                if not entry.waiter.done():
                    return entry.waiter  # one future per id, shared by its waiters
                del self._outputs[oid]  # its waiter was cancelled: start afresh
            fut = Future()
            self._transition(oid, OutputEvent.WAIT, fx, now=time.monotonic(), future=fut)
        self._run(fx)
        return fut

    def release_output(self, oid: str) -> None:
        fx = _Effects()
        with self._lock:
            self._forget_released_locked()
            self._transition(oid, OutputEvent.RELEASE, fx, now=time.monotonic())
        self._run(fx)

    # -- housekeeping (pump calls it periodically) -------------------------------------------
    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        fx = _Effects()
        with self._lock:
            self._forget_released_locked()
            for oid in list(self._outputs):
                self._transition(oid, OutputEvent.EXPIRE, fx, now=now)
        self._run(fx)
        self.freer.flush()

    def fail_all(self, exc: BaseException) -> None:
        """Mark the executor dead and fail everything pending (idempotent)."""
        with self._lock:
            if self._dead is None:
                self._dead = exc
            rpcs = list(self._rpcs.values())
            outputs = list(self._outputs.values())
            self._rpcs.clear()
            self._outputs.clear()
            self._abandoned.clear()
        err = ExecutorDeadError(str(exc))
        for p in rpcs:
            set_exception(p.future, err)
        for entry in outputs:
            if entry.state is OutputState.WAITING:
                set_exception(entry.waiter, err)
            elif entry.state is OutputState.ARRIVED:
                _discard(entry.result)


def _undeclared(exc: Exception) -> str:
    return f"the runner replied with a message its protocol does not declare ({exc})"


def _discard(result: Any) -> None:
    if isinstance(result, OutputLease):
        result.release()
