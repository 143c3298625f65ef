"""Round trips through the output arena: dtypes, shapes, layouts, nesting, the
slot allocator, and backpressure when the arena is full."""

from __future__ import annotations

import concurrent.futures
import queue
import threading

import pytest
import torch
from runtime_helpers import config
from runtime_test_runners import Make, make_tensor
from waiting import wait_until

from diffrt.platforms.cpu import CpuPlatform
from diffrt.runtime import WorkerError
from diffrt.runtime.factory import make_executor
from diffrt.runtime.messages import FreeSlots, OutputPending, OutputReady, encode, result_decoder
from diffrt.runtime.output_thread import OutputWriter, OutputWriterClosed
from diffrt.runtime.shm_transport import (
    ALIGN,
    Arena,
    ArenaFullError,
    PackPlan,
    SlotAllocator,
    read_views,
)


@pytest.fixture(scope="module")
def arena():
    a = Arena.create(4 << 20)
    yield a
    a.close()


def roundtrip(arena: Arena, value):
    plan = PackPlan(value)
    alloc = SlotAllocator(arena.size)
    off, gen = alloc.try_allocate(plan.slot_bytes)
    arena.bytes_view(off, plan.slot_bytes).fill_(0xAB)  # garbage where the bytes should go
    plan.copy_into(arena, off, lambda d, s: d.copy_(s))
    msg = result_decoder.decode(encode(OutputReady("b", [plan.key_output("b/0", off, gen)])))
    return read_views(arena, msg.outputs[0]), plan


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8", "int64", "bool"])
@pytest.mark.parametrize("shape", [[], [0], [7], [2, 3, 5], [1, 3, 17, 9]])
def test_dtype_and_shape_round_trip_bit_exact(arena, dtype, shape):
    t = make_tensor(3, shape, dtype)
    got, plan = roundtrip(arena, t)
    assert got.dtype == t.dtype and got.shape == t.shape  # no upcast of bf16/fp16
    assert torch.equal(got, t)
    assert plan.nbytes == t.numel() * t.element_size()


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "permuted"])
def test_non_contiguous_sources(arena, layout):
    base = make_tensor(1, [6, 8, 4], "bfloat16")
    t = {"transposed": base[0].t(), "strided": base[:, ::2, 1],
         "expanded": base[0, 0, :1].expand(5, 3), "permuted": base.permute(2, 0, 1)}[layout]
    assert not t.is_contiguous()
    got, _ = roundtrip(arena, t)
    assert got.is_contiguous() and torch.equal(got, t)


def test_slice_of_a_batch_carries_only_its_own_bytes(arena):
    batch = make_tensor(0, [8, 3, 64, 64], "uint8")  # 8 requests
    got, plan = roundtrip(arena, batch[5])
    assert plan.nbytes == 3 * 64 * 64 and plan.slot_bytes < 2 * 3 * 64 * 64
    assert torch.equal(got, batch[5])


def test_nested_containers_keep_their_structure(arena):
    value = {"images": [make_tensor(0, [2, 2], "uint8"), make_tensor(1, [3], "float16")],
             "pair": (make_tensor(2, [1], "bfloat16"), "label", None, 3.5),
             "inner": {"deep": [[make_tensor(3, [2], "float32")]]}}
    got, plan = roundtrip(arena, value)
    assert isinstance(got["images"], list) and isinstance(got["pair"], tuple)
    assert got["pair"][1:] == ("label", None, 3.5)
    assert torch.equal(got["inner"]["deep"][0][0], value["inner"]["deep"][0][0])
    assert torch.equal(got["images"][1], value["images"][1])
    assert all(m.offset % ALIGN == 0 for m in plan.metas)


def test_allocator_first_fit_reuse_coalescing_and_stale_frees():
    a = SlotAllocator(10 * ALIGN)
    s1 = a.try_allocate(ALIGN)
    s2 = a.try_allocate(3 * ALIGN)
    s3 = a.try_allocate(ALIGN)
    assert [s[0] for s in (s1, s2, s3)] == [0, ALIGN, 4 * ALIGN]
    assert a.free(*s2)
    assert not a.free(*s2)  # duplicate free ignored
    assert not a.free(s1[0], s1[1] + 1)  # wrong generation ignored
    s4 = a.try_allocate(2 * ALIGN)
    assert s4[0] == ALIGN  # the lowest (warm) address is reused first
    a.free(*s1)
    a.free(*s4)
    a.free(*s3)
    assert a.try_allocate(10 * ALIGN)[0] == 0  # everything coalesced back
    assert a.try_allocate(1) is None
    with pytest.raises(ArenaFullError, match="max_pending_output_bytes"):
        a.try_allocate(11 * ALIGN)


def test_writer_waits_for_frees_when_the_arena_is_full():
    arena = Arena.create(64 << 10)
    frees: queue.Queue[FreeSlots] = queue.Queue()
    sent: queue.Queue = queue.Queue()
    waits: list[float] = []  # the writer waits for frees only when it needs room

    def source(timeout):
        if timeout > 0:
            waits.append(timeout)
        try:
            return frees.get(timeout=timeout) if timeout > 0 else frees.get_nowait()
        except queue.Empty:
            return None

    writer = OutputWriter(CpuPlatform(), arena, source, sent.put, queue_depth=1)
    try:
        big = torch.ones(40 << 10, dtype=torch.uint8)
        assert writer.submit("b1", {"k": "b1/0"}, {"k": big})
        first = sent.get(timeout=10)
        assert writer.submit("b2", {"k": "b2/0"}, {"k": big * 2})
        wait_until(lambda: waits, message="the writer never waited for room")
        # no room until the first slot comes back: only "still pending" notices
        pending = sent.get(timeout=10)
        assert isinstance(pending, OutputPending) and pending.output_ids == ["b2/0"]
        out = first.outputs[0]
        frees.put(FreeSlots([(out.slot_offset, out.generation)]))
        second = sent.get(timeout=10)
        while isinstance(second, OutputPending):
            second = sent.get(timeout=10)
        assert torch.equal(read_views(arena, second.outputs[0]), big * 2)
        # an output larger than the whole arena fails cleanly instead of waiting forever
        assert writer.submit("b3", {"k": "b3/0"}, {"k": torch.ones(1 << 20, dtype=torch.uint8)})
        failed = sent.get(timeout=10)
        assert failed.failed_ids == ["b3/0"] and "ArenaFullError" in failed.error
    finally:
        writer.close()
        arena.close()


def test_a_dead_output_thread_fails_queued_outputs_and_never_blocks_submit():
    arena = Arena.create(64 << 10)
    sent: queue.Queue = queue.Queue()
    release = threading.Event()
    calls = []

    def source(timeout):  # the first idle drain blocks, then raises: the thread dies
        calls.append(timeout)
        if len(calls) == 1:
            release.wait(10)
            raise OSError("free channel broken")
        return None

    writer = OutputWriter(CpuPlatform(), arena, source, sent.put, queue_depth=1)
    try:
        wait_until(lambda: calls)  # the thread is inside its idle drain
        assert writer.submit("b1", {"k": "b1/0"}, {"k": torch.ones(8)})  # queued, not copied
        release.set()
        failed = sent.get(timeout=10)
        assert failed.async_output_id == "b1" and failed.failed_ids == ["b1/0"] and failed.error
        with pytest.raises(OutputWriterClosed):
            writer.submit("b2", {"k": "b2/0"}, {"k": torch.ones(8)})  # fails, never hangs
    finally:
        release.set()
        writer.close()
        arena.close()


def test_slow_consumer_throttles_the_worker_end_to_end():
    ex = make_executor("inproc", config(max_pending_output_bytes=64 << 10, output_queue_depth=1))
    try:
        req = Make(keys=["k"], shape=[40 << 10], dtype="uint8")
        outs = [ex.execute(req), ex.execute(req), ex.execute(req)]
        # #1 fills the arena, #2 waits in the writer, #3 in the queue: #4 must wait
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fourth = pool.submit(ex.execute, req)
            with pytest.raises(concurrent.futures.TimeoutError):
                fourth.result(timeout=0.3)
            for out in outs:  # the consumer catches up: everything flows again
                value = ex.wait_output_ready(out.output_ids["k"]).result(timeout=10).take()
                assert torch.equal(value, make_tensor(0, [40 << 10], "uint8"))
            out4 = fourth.result(timeout=10)
        ex.wait_output_ready(out4.output_ids["k"]).result(timeout=10).release()
        too_big = ex.execute(Make(keys=["k"], shape=[1 << 20], dtype="uint8"))
        with pytest.raises(WorkerError, match="max_pending_output_bytes"):
            ex.wait_output_ready(too_big.output_ids["k"]).result(timeout=10)
        assert ex.is_healthy()
    finally:
        ex.shutdown()


def test_concurrent_waiters_get_their_own_outputs():
    ex = make_executor("inproc", config(max_pending_output_bytes=8 << 20))
    try:
        results: dict[int, bool] = {}

        def consume(i: int, oid: str) -> None:
            v = ex.wait_output_ready(oid).result(timeout=30).take()
            results[i] = torch.equal(v, make_tensor(i % 3, [33], "float16"))

        threads = []
        for i in range(24):
            out = ex.execute(Make(keys=["a", "b", "c"], shape=[33], dtype="float16"))
            t = threading.Thread(target=consume, args=(i, out.output_ids["abc"[i % 3]]))
            t.start()
            threads.append(t)
            for k in "abc":
                if k != "abc"[i % 3]:
                    ex.release_output(out.output_ids[k])
        for t in threads:
            t.join(30)
        assert len(results) == 24 and all(results.values())
        empty = {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}
        wait_until(lambda: ex.router.counts() == empty, message=lambda: str(ex.router.counts()))
    finally:
        ex.shutdown()


def test_batch_slots_are_all_or_nothing_and_freed_one_by_one():
    a = SlotAllocator(8 * ALIGN)
    held = a.try_allocate(3 * ALIGN)
    assert a.try_allocate_many([ALIGN, 4 * ALIGN, ALIGN]) is None  # 6 wanted, 5 free
    assert a.used_bytes == 3 * ALIGN  # nothing taken by the failed attempt
    a.free(*held)
    slots = a.try_allocate_many([ALIGN, 4 * ALIGN, ALIGN])
    assert [s[0] for s in slots] == [0, ALIGN, 5 * ALIGN]
    assert len({g for _, g in slots}) == 3
    a.free(*slots[1])
    assert a.try_allocate(4 * ALIGN)[0] == ALIGN  # one key's slot is reusable on its own
    with pytest.raises(ArenaFullError):
        a.try_allocate_many([5 * ALIGN, 4 * ALIGN])


def test_a_batch_larger_than_the_arena_arrives_piece_by_piece():
    """Two 40 KiB outputs of one batch in a 64 KiB arena: the first is sent as
    soon as it is copied, the second once the first is read and freed."""
    ex = make_executor("inproc", config(max_pending_output_bytes=64 << 10))
    try:
        out = ex.execute(Make(keys=["a", "b"], shape=[40 << 10], dtype="uint8"))
        first = ex.wait_output_ready(out.output_ids["a"]).result(timeout=10)
        second = ex.wait_output_ready(out.output_ids["b"])
        with pytest.raises(concurrent.futures.TimeoutError):
            second.result(timeout=0.3)  # no room until the first is freed
        assert torch.equal(first.take(), make_tensor(0, [40 << 10], "uint8"))
        assert torch.equal(second.result(timeout=10).take(), make_tensor(1, [40 << 10], "uint8"))
        too_big = ex.execute(Make(keys=["a", "b"], shape=[80 << 10], dtype="uint8"))
        for oid in too_big.output_ids.values():  # one output larger than the arena fails alone
            with pytest.raises(WorkerError, match="max_pending_output_bytes"):
                ex.wait_output_ready(oid).result(timeout=10)
        wait_until(lambda: ex.core.writer.used_bytes == 0)
        assert ex.is_healthy()
    finally:
        ex.shutdown()


def test_on_the_synchronous_path_a_batch_larger_than_the_arena_fails_at_once():
    """Copied before COMPUTE_DONE, nobody could read a first part to make room:
    the whole call's outputs fail at once instead of waiting for ever."""
    ex = make_executor("inproc", config(max_pending_output_bytes=64 << 10, async_output=False))
    try:
        out = ex.execute(Make(keys=["a", "b"], shape=[40 << 10], dtype="uint8"))
        for oid in out.output_ids.values():
            with pytest.raises(WorkerError, match="max_pending_output_bytes"):
                ex.wait_output_ready(oid).result(timeout=10)
        fits = ex.execute(Make(keys=["a", "b"], shape=[20 << 10], dtype="uint8"))
        for i, oid in enumerate(fits.output_ids.values()):
            assert torch.equal(ex.wait_output_ready(oid).result(timeout=10).take(),
                               make_tensor(i, [20 << 10], "uint8"))
        assert ex.is_healthy()
    finally:
        ex.shutdown()


def test_the_writer_page_locks_the_arena_where_the_platform_can():
    """The arena is registered for the writer's life (device-to-host copies
    into it are then real asynchronous DMA), unregistered when it closes; the
    CPU platform has nothing to copy and registers nothing."""
    from diffrt_simdevice.platform import SimDevicePlatform

    sim = SimDevicePlatform(copy_delay_s=0.0)
    arena = Arena.create(1 << 20)
    try:
        writer = OutputWriter(sim, arena, lambda timeout: None, lambda msg: None)
        assert writer.host_path == "page-locked"
        assert sim.is_page_locked(arena.bytes_view(4096, 1024))
        writer.close()
        assert not sim.is_page_locked(arena.bytes_view(4096, 1024))

        # no in-place registration (XPU): staged through pinned buffers
        writer = OutputWriter(SimDevicePlatform(copy_delay_s=0.0, host_register=False), arena,
                              lambda t: None, lambda msg: None)
        assert writer.host_path == "staged"
        writer.close()
        writer = OutputWriter(SimDevicePlatform(copy_delay_s=0.0, host_register=False,
                                                pinned=False),
                              arena, lambda t: None, lambda msg: None)
        assert writer.host_path == "pageable"
        writer.close()
        writer = OutputWriter(CpuPlatform(), arena, lambda t: None, lambda msg: None)
        assert writer.host_path == "host"
        writer.close()
    finally:
        arena.close()


def test_host_copies_on_the_output_thread_are_plain_memcpy():
    """copy_host moves bytes exactly (any dtype, bfloat16 included) without a
    torch op, so the output thread never starts an OpenMP team of its own;
    what it cannot memcpy (a strided source) still copies correctly."""
    from unittest import mock

    from diffrt.runtime.shm_transport import copy_host

    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
        src = (torch.arange(4096) % 251).to(dtype).reshape(64, 64)
        dst = torch.zeros_like(src)
        with mock.patch.object(torch.Tensor, "copy_", side_effect=AssertionError("torch op")):
            copy_host(dst, src)
        assert torch.equal(dst, src)
    strided = torch.arange(64.0).reshape(8, 8).t()
    dst = torch.zeros(8, 8)
    copy_host(dst, strided)
    assert torch.equal(dst, strided)
