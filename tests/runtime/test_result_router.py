"""Message-ordering races and lifetimes in the executor's router, driven by
synthetic messages in every order (no threads, no processes)."""

from __future__ import annotations

import concurrent.futures
import gc
import time

import pytest
import torch

from diffrt.runtime import ExecutorDeadError, OutputTimeoutError, RunnerOutput, WorkerError
from diffrt.runtime.messages import (
    ComputeDone,
    FreeSlots,
    OutputReady,
    RpcKind,
    RpcResult,
    encode,
    encode_raw,
    output_ids_for,
    result_decoder,
)
from diffrt.runtime.result_router import ResultRouter
from diffrt.runtime.shm_transport import Arena, PackPlan, SlotAllocator
from diffrt.runtime.slot_freer import SlotFreer


class Harness:
    """A router plus the writer side of its arena; frees land in ``freed``."""

    def __init__(self, world_size: int = 1, timeout: float = 100.0):
        self.arena = Arena.create(1 << 20)
        self.alloc = SlotAllocator(self.arena.size)
        self.freed: list[tuple[int, int]] = []
        self.freed_ids: list[str] = []
        self.router = ResultRouter(world_size, self.arena, SlotFreer(self._sink), timeout)

    def _sink(self, msg: FreeSlots) -> None:
        self.freed.extend(msg.slots)
        self.freed_ids.extend(msg.ids)

    def send(self, msg) -> None:
        # every message round-trips through msgspec, as over a real channel
        self.router.on_message(result_decoder.decode(encode(msg)))

    def execute(self, keys: list[str]):
        rpc_id, fut = self.router.new_rpc(RpcKind.EXECUTE)
        batch, ids = output_ids_for(rpc_id, keys)
        return rpc_id, fut, batch, ids

    def compute_done(self, rpc_id: int, batch: str, ids: dict[str, str], rank: int = 0):
        return ComputeDone(rpc_id, rank, reply=encode_raw({"n": len(ids)}), async_output_id=batch,
                           output_ids=ids)

    def output_ready(self, batch: str, ids: dict[str, str]) -> OutputReady:
        outs = []
        for i, (_, oid) in enumerate(ids.items()):
            plan = PackPlan(torch.full((4,), float(i)))
            off, gen = self.alloc.try_allocate(plan.slot_bytes)
            plan.copy_into(self.arena, off, lambda d, s: d.copy_(s))
            outs.append(plan.key_output(oid, off, gen))
        return OutputReady(batch, outs)


def _value(fut: concurrent.futures.Future, i: int) -> None:
    lease = fut.result(timeout=0)
    assert torch.equal(lease.take(), torch.full((4,), float(i)))


@pytest.mark.parametrize("order", ["done_ready_wait", "ready_done_wait", "done_wait_ready",
                                   "ready_wait_done"])
def test_any_order_of_compute_done_output_ready_and_waiter(order):
    h = Harness()
    rpc_id, fut, batch, ids = h.execute(["a", "b", "c"])
    waits = {}
    for step in order.split("_"):
        if step == "done":
            h.send(h.compute_done(rpc_id, batch, ids))
            assert fut.result(timeout=0).output_ids == ids
        elif step == "ready":
            h.send(h.output_ready(batch, ids))
        else:  # the engine learns the per-key ids from COMPUTE_DONE, or derives them
            waits = {k: h.router.wait_output_ready(oid) for k, oid in ids.items()}
    for i, k in enumerate(["a", "b", "c"]):
        _value(waits[k], i)
    assert len(h.freed) == 3
    assert h.router.counts() == {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}


def test_batch_split_with_some_waiters_before_and_some_after_arrival():
    h = Harness()
    rpc_id, fut, batch, ids = h.execute(["a", "b", "c"])
    early = h.router.wait_output_ready(ids["b"])
    h.send(h.output_ready(batch, ids))  # before COMPUTE_DONE registered anything
    assert early.done()
    h.send(h.compute_done(rpc_id, batch, ids))
    _value(early, 1)
    _value(h.router.wait_output_ready(ids["c"]), 2)
    _value(h.router.wait_output_ready(ids["a"]), 0)
    assert h.router.counts()["arrived"] == 0


def test_cancelled_waiter_never_breaks_routing_and_output_can_be_claimed_again():
    h = Harness()
    rpc_id, _, batch, ids = h.execute(["a"])
    fut = h.router.wait_output_ready(ids["a"])
    assert fut.cancel()
    h.send(h.output_ready(batch, ids))  # must not raise InvalidStateError in the pump
    h.send(h.compute_done(rpc_id, batch, ids))
    _value(h.router.wait_output_ready(ids["a"]), 0)


def test_waiting_again_after_cancelling_gets_a_live_future():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    h.router.wait_output_ready(ids["a"]).cancel()
    again = h.router.wait_output_ready(ids["a"])
    assert not again.done() and h.router.wait_output_ready(ids["a"]) is again
    h.send(h.output_ready(batch, ids))
    _value(again, 0)


def test_release_before_arrival_frees_on_arrival_not_cached():
    h = Harness()
    rpc_id, _, batch, ids = h.execute(["a", "b"])
    h.send(h.compute_done(rpc_id, batch, ids))
    h.router.release_output(ids["a"])  # aborted request
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 1  # a's slot went straight back
    assert h.router.counts()["arrived"] == 1 and h.router.counts()["dropped"] == 0
    h.router.release_output(ids["b"])  # after arrival: freed at once
    assert len(h.freed) == 2
    assert h.router.counts() == {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}


def test_release_cancels_a_waiting_future():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    fut = h.router.wait_output_ready(ids["a"])
    h.router.release_output(ids["a"])
    assert fut.cancelled()
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 1


def test_waiter_timeout_then_late_arrival_is_freed():
    h = Harness(timeout=5.0)
    _, _, batch, ids = h.execute(["a"])
    fut = h.router.wait_output_ready(ids["a"])
    h.router.expire(now=1e12)
    with pytest.raises(OutputTimeoutError, match="DIFFRT_OUTPUT_TIMEOUT_S"):
        fut.result(timeout=0)
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 1 and h.router.counts()["arrived"] == 0


def test_unclaimed_output_is_freed_after_the_timeout():
    h = Harness(timeout=5.0)
    _, _, batch, ids = h.execute(["a"])
    h.send(h.output_ready(batch, ids))
    h.router.expire()
    assert h.router.counts()["arrived"] == 1  # not yet
    h.router.expire(now=1e12)
    assert h.router.counts()["arrived"] == 0 and len(h.freed) == 1


def test_execute_timeout_frees_outputs_that_come_later():
    h = Harness()
    rpc_id, fut, batch, ids = h.execute(["a"])
    with pytest.raises(TimeoutError):
        h.router.wait_rpc(rpc_id, fut, timeout=0.01)
    h.send(h.compute_done(rpc_id, batch, ids))
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 1 and h.router.counts()["arrived"] == 0


def test_lease_collected_without_release_gives_the_slot_back():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    h.send(h.output_ready(batch, ids))
    lease = h.router.wait_output_ready(ids["a"]).result(timeout=0)
    assert lease.value.sum().item() == 0
    del lease
    gc.collect()
    assert len(h.freed) == 1


def test_release_is_idempotent_and_take_after_release_refuses():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    h.send(h.output_ready(batch, ids))
    lease = h.router.wait_output_ready(ids["a"]).result(timeout=0)
    lease.release()
    lease.release()
    assert len(h.freed) == 1
    with pytest.raises(RuntimeError, match="already released"):
        lease.take()


def test_packing_error_fails_each_key():
    h = Harness()
    _, _, batch, ids = h.execute(["a", "b"])
    fut = h.router.wait_output_ready(ids["a"])
    h.send(OutputReady(batch, [], error="ArenaFullError: too big", failed_ids=list(ids.values())))
    with pytest.raises(WorkerError, match="too big"):
        fut.result(timeout=0)
    with pytest.raises(WorkerError, match="too big"):
        h.router.wait_output_ready(ids["b"]).result(timeout=0)


def test_two_ranks_execute_completes_after_every_ack_and_rank1_error_orphans_outputs():
    h = Harness(world_size=2)
    rpc_id, fut, batch, ids = h.execute(["a"])
    h.send(h.compute_done(rpc_id, batch, ids))
    assert not fut.done()  # rank 1 has not acknowledged
    h.send(RpcResult(rpc_id, 1))
    assert isinstance(fut.result(timeout=0), RunnerOutput)

    rpc_id, fut, batch, ids = h.execute(["b"])
    h.send(h.compute_done(rpc_id, batch, ids))
    h.send(RpcResult(rpc_id, 1, error="ValueError: rank 1 broke"))
    with pytest.raises(WorkerError, match="rank 1"):
        fut.result(timeout=0)
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 1  # nobody could ever claim it

    rpc_id, fut, batch, ids = h.execute(["c"])  # rank 1 fails before rank 0 is done
    h.send(RpcResult(rpc_id, 1, error="ValueError: early"))
    h.send(h.compute_done(rpc_id, batch, ids))
    h.send(h.output_ready(batch, ids))
    assert len(h.freed) == 2


def test_collective_gathers_one_result_per_rank():
    h = Harness(world_size=2)
    rpc_id, fut = h.router.new_rpc(RpcKind.COLLECTIVE)
    h.send(RpcResult(rpc_id, 1, reply=encode_raw("one")))
    assert not fut.done()
    h.send(RpcResult(rpc_id, 0, reply=encode_raw("zero")))
    assert fut.result(timeout=0) == ["zero", "one"]


def test_fail_all_fails_everything_and_frees_unclaimed_outputs():
    h = Harness()
    rpc_id, fut, batch, ids = h.execute(["a", "b"])
    h.send(h.compute_done(rpc_id, batch, ids))
    waiting = h.router.wait_output_ready("out-77/0")
    pending_rpc_id, pending = h.router.new_rpc(RpcKind.EXECUTE)
    h.send(h.output_ready(batch, ids))  # unclaimed
    h.router.fail_all(RuntimeError("worker rank 0 died"))
    for f in (waiting, pending):
        with pytest.raises(ExecutorDeadError, match="died"):
            f.result(timeout=0)
    assert len(h.freed) == 2
    with pytest.raises(ExecutorDeadError):
        h.router.new_rpc(RpcKind.EXECUTE)
    with pytest.raises(ExecutorDeadError):
        h.router.wait_output_ready(ids["a"]).result(timeout=0)


def test_future_callbacks_may_call_back_into_the_router():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    seen = []
    fut = h.router.wait_output_ready(ids["a"])
    fut.add_done_callback(lambda f: (seen.append(h.router.counts()), f.result().release()))
    h.send(h.output_ready(batch, ids))  # the callback runs outside the router's lock
    assert seen and len(h.freed) == 1


def test_release_after_hand_over_leaves_the_slot_to_the_lease_holder():
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    h.send(h.output_ready(batch, ids))
    lease = h.router.wait_output_ready(ids["a"]).result(timeout=0)
    h.router.release_output(ids["a"])  # e.g. an abort racing with post-processing
    h.router.expire()
    assert h.freed == [] and h.freed_ids == []  # the lease is still being read
    assert lease.value.sum().item() == 0
    lease.release()
    h.router.release_output(ids["a"])  # after the lease is gone: harmless
    assert len(h.freed) == 1


@pytest.mark.parametrize("waiter_first", [True, False])
def test_release_racing_with_the_hand_over_never_frees_a_lease_being_delivered(waiter_first):
    h = Harness()
    _, _, batch, ids = h.execute(["a"])
    real_run = h.router._run

    def run_after_a_release(fx):
        # the engine aborts the request after the output left the router's
        # table but before its future is resolved (effects run outside the lock)
        for oid, _, _ in fx.hand_over:
            h.router.release_output(oid)
        real_run(fx)

    if waiter_first:
        fut = h.router.wait_output_ready(ids["a"])
        h.router._run = run_after_a_release
        h.send(h.output_ready(batch, ids))
    else:
        h.send(h.output_ready(batch, ids))
        h.router._run = run_after_a_release
        fut = h.router.wait_output_ready(ids["a"])
    lease = fut.result(timeout=0)
    h.router.freer.flush()
    assert h.freed == [] and h.freed_ids == []  # the slot stays the lease holder's
    lease.release()
    assert len(h.freed) == 1


def test_dropped_ids_reach_the_writer_so_lost_messages_cannot_leak_slots():
    h = Harness(timeout=5.0)
    _, _, batch, ids = h.execute(["a", "b"])
    h.router.release_output(ids["a"])
    h.router.wait_output_ready(ids["b"])
    h.router.expire(now=1e12)  # b's waiter times out; the periodic flush sends both ids
    assert sorted(h.freed_ids) == sorted(ids.values())


def test_waiting_for_a_dropped_or_claimed_output_fails_at_once():
    h = Harness()
    _, _, batch, ids = h.execute(["a", "b"])
    h.router.release_output(ids["a"])
    with pytest.raises(Exception, match="already dropped"):
        h.router.wait_output_ready(ids["a"]).result(timeout=0)
    fut = h.router.wait_output_ready(ids["b"])
    h.send(h.output_ready(batch, ids))
    lease = fut.result(timeout=0)
    with pytest.raises(Exception, match="already claimed"):
        h.router.wait_output_ready(ids["b"]).result(timeout=0)
    lease.release()
    # a was freed on arrival, b by its holder; the execute itself never completed
    assert h.router.counts() == {"rpcs": 1, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}
    assert len(h.freed) == 2


def test_every_output_state_and_event_pair_goes_where_the_table_says():
    """Each (state, event) pair of the router's output table, from a fresh
    setup each time: the state the output is in afterwards (None: no entry).
    The ARRIVE carries an error (no slot); EXPIRE is far past every deadline."""
    from diffrt.runtime.messages import OutputPending
    from diffrt.runtime.result_router import OutputEvent as E
    from diffrt.runtime.result_router import OutputState as S
    from diffrt.runtime.result_router import _Effects

    after = {
        None: {E.WAIT: S.WAITING, E.ARRIVE: S.ARRIVED, E.RELEASE: S.DROPPED,
               E.PENDING: S.BLOCKED, E.HANDOVER_FAILED: None, E.LEASE_DONE: None,
               E.EXPIRE: None},
        S.BLOCKED: {E.WAIT: S.WAITING, E.ARRIVE: S.ARRIVED, E.RELEASE: S.DROPPED,
                    E.PENDING: S.BLOCKED, E.HANDOVER_FAILED: S.BLOCKED,
                    E.LEASE_DONE: S.BLOCKED, E.EXPIRE: None},
        S.WAITING: {E.WAIT: S.WAITING, E.ARRIVE: None, E.RELEASE: S.DROPPED,
                    E.PENDING: S.WAITING, E.HANDOVER_FAILED: S.WAITING,
                    E.LEASE_DONE: S.WAITING, E.EXPIRE: S.DROPPED},
        S.ARRIVED: {E.WAIT: S.CLAIMED, E.ARRIVE: S.ARRIVED, E.RELEASE: None,
                    E.PENDING: S.ARRIVED, E.HANDOVER_FAILED: S.ARRIVED,
                    E.LEASE_DONE: S.ARRIVED, E.EXPIRE: None},
        S.CLAIMED: {E.WAIT: S.CLAIMED, E.ARRIVE: S.CLAIMED, E.RELEASE: S.CLAIMED,
                    E.PENDING: S.CLAIMED, E.HANDOVER_FAILED: None, E.LEASE_DONE: None,
                    E.EXPIRE: S.CLAIMED},
        S.DROPPED: {E.WAIT: S.DROPPED, E.ARRIVE: None, E.RELEASE: S.DROPPED,
                    E.PENDING: S.DROPPED, E.HANDOVER_FAILED: S.DROPPED,
                    E.LEASE_DONE: S.DROPPED, E.EXPIRE: None},
    }
    assert set(after) == {None, *S} and all(set(row) == set(E) for row in after.values())
    for state, row in after.items():
        for event, expected in row.items():
            h = Harness(timeout=1.0)
            _, _, batch, ids = h.execute(["a"])
            oid = ids["a"]
            held = None  # a claimed lease must stay alive, or its release removes the entry
            if state is S.BLOCKED:
                h.send(OutputPending(batch, [oid]))
            elif state is S.WAITING:
                h.router.wait_output_ready(oid)
            elif state is S.ARRIVED:
                h.send(h.output_ready(batch, ids))
            elif state is S.CLAIMED:
                h.send(h.output_ready(batch, ids))
                held = h.router.wait_output_ready(oid).result(timeout=0)
            elif state is S.DROPPED:
                h.router.release_output(oid)
            fx = _Effects()
            with h.router._lock:
                h.router._transition(oid, event, fx, now=1e12, result=RuntimeError("x"),
                                     future=concurrent.futures.Future())
                entry = h.router._outputs.get(oid)
                got = entry.state if entry is not None else None
            assert got is expected, (state, event, got)
            h.router._run(fx)
            del held

def test_an_output_waiting_for_arena_room_is_not_declared_lost():
    from diffrt.runtime.messages import PENDING_NOTICE_S, OutputPending

    h = Harness(timeout=0.1)
    _, _, batch, ids = h.execute(["a"])
    h.send(OutputPending(batch, [ids["a"]]))  # before anyone waits: BLOCKED
    assert h.router.counts()["blocked"] == 1
    fut = h.router.wait_output_ready(ids["a"])
    h.router.expire(now=time.monotonic() + 0.5)  # past output_timeout_s, within the notice window
    assert not fut.done()
    h.send(OutputPending(batch, [ids["a"]]))  # still waiting for room: the wait goes on
    h.send(h.output_ready(batch, ids))
    _value(fut, 0)
    # without notices the ordinary timeout applies again
    _, _, batch, ids = h.execute(["b"])
    h.send(OutputPending(batch, [ids["b"]]))
    late = h.router.wait_output_ready(ids["b"])
    h.router.expire(now=time.monotonic() + 3 * PENDING_NOTICE_S + 1)
    with pytest.raises(OutputTimeoutError):
        late.result(timeout=0)
