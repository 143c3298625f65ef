"""The simulated asynchronous device: a missing wait shows up as wrong data."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

pytest.importorskip("diffrt_simdevice", reason="pip install ./tests/plugins/diffrt_simdevice")
from diffrt_simdevice.platform import SimDevicePlatform, SimEvent  # noqa: E402

from diffrt.platforms.pinned_pool import PinnedBufferPool  # noqa: E402

DELAY = 0.02


#: every gate the module's tests opened: set at teardown, so a test that
#: failed before releasing its stream does not hang the fixture's synchronize
GATES: list[threading.Event] = []


@pytest.fixture(scope="module")
def sim():
    platform = SimDevicePlatform(copy_delay_s=DELAY)
    yield platform
    for flag in GATES:
        flag.set()
    platform.synchronize()


def locked(sim, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, page-locked: copies into it are asynchronous. Unlocked
    when the tensor goes: a later pageable tensor at the same address must
    not pass for page-locked (the simulated device locks address ranges)."""
    weakref.finalize(tensor, sim.unregister_host_memory, sim.register_host_memory(tensor))
    return tensor


def gate(sim, stream=None) -> threading.Event:
    """Stall ``stream`` until the returned flag is set (no timing assumptions)."""
    flag = threading.Event()
    GATES.append(flag)
    sim.launch(flag.wait, stream)
    return flag


def test_copy_read_before_its_event_is_stale_and_right_after(sim):
    side = sim.new_side_stream()
    dst, src = locked(sim, torch.zeros(1000)), torch.arange(1000.0)
    release = gate(sim, side)
    sim.copy_async(dst, src, side)
    event = sim.record_device_event(side)
    assert sim.event_query(event) is False
    assert torch.count_nonzero(dst) == 0  # the copy has not landed: wrong data
    release.set()
    sim.event_synchronize(event)
    assert sim.event_query(event) is True
    assert torch.equal(dst, src)


def test_event_completes_only_after_work_queued_before_it(sim):
    order: list[str] = []
    release = gate(sim)
    sim.launch(lambda: order.append("kernel"), delay_s=DELAY)
    event = sim.record_device_event()
    assert not event.query() and order == [] and not sim.current_stream().query()
    release.set()
    event.synchronize()
    assert order == ["kernel"]


def test_wait_event_orders_streams(sim):
    """A late "forward" on the compute stream, then a copy on a side stream."""
    out, host = torch.zeros(8), locked(sim, torch.zeros(8))
    side = sim.new_side_stream()
    sim.launch(lambda: out.fill_(7.0), delay_s=DELAY)  # forward produces its output late
    sim.wait_event(side, sim.record_device_event())
    sim.copy_async(host, out, side)
    done = sim.record_device_event(side)
    sim.event_synchronize(done)
    assert torch.all(host == 7.0)


def test_without_wait_event_the_copy_reads_unfinished_output(sim):
    out, host = torch.zeros(8), locked(sim, torch.ones(8))
    side = sim.new_side_stream()
    forward_done = gate(sim)  # compute stream stalls until released
    sim.launch(lambda: out.fill_(7.0))
    sim.copy_async(host, out, side)  # no wait: races the forward and loses
    sim.event_synchronize(sim.record_device_event(side))
    assert torch.all(host == 0.0)
    forward_done.set()
    sim.synchronize()
    assert torch.all(out == 7.0)


def test_a_copy_into_pageable_memory_blocks_its_thread_until_it_landed(sim):
    """As on CUDA: only page-locked memory gets an asynchronous copy."""
    side = sim.new_side_stream()
    pageable, src = torch.zeros(16), torch.arange(16.0)
    release = gate(sim, side)
    returned = threading.Event()
    t = threading.Thread(target=lambda: (sim.copy_async(pageable, src, side), returned.set()))
    t.start()
    assert not returned.wait(0.2)  # still blocked behind the stalled stream
    release.set()
    assert returned.wait(10) and torch.equal(pageable, src)  # landed when it returned
    t.join()
    handle = sim.register_host_memory(pageable)
    sim.copy_async(pageable, src, side)  # page-locked: returns at once
    sim.unregister_host_memory(handle)
    sim.synchronize()


def test_stream_context_is_thread_local(sim):
    side = sim.new_side_stream()
    seen: list[object] = []
    with sim.stream_context(side):
        assert sim.current_stream() is side
        t = threading.Thread(target=lambda: seen.append(sim.current_stream()))
        t.start()
        t.join()
    assert seen == [sim._default] and sim.current_stream() is sim._default


def test_pool_with_simdevice_keeps_slot_until_copy_landed(sim):
    pool = PinnedBufferPool(sim)
    side = sim.new_side_stream()
    slot = pool.acquire((4,), torch.float32)
    release = gate(sim, side)
    sim.copy_async(slot.tensor, torch.ones(4), side)
    pool.release(slot, sim.record_device_event(side))
    other = pool.acquire((4,), torch.float32)
    assert other is not slot  # the copy into slot is still in flight
    release.set()
    sim.synchronize()
    pool.release(other)
    reused = pool.acquire((4,), torch.float32)
    assert reused in (slot, other) and len(pool) == 2


def test_family_checks_and_failures_surface(sim):
    with pytest.raises(TypeError, match="SimEvent"):
        sim.wait_event(sim.new_side_stream(), torch.Event("cpu"))
    with pytest.raises(TypeError, match="SimStream"):
        sim.record_device_event(object())
    assert isinstance(sim.record_device_event(), SimEvent)

    broken = SimDevicePlatform(copy_delay_s=0)

    def fail() -> None:
        raise ValueError("bad kernel")

    broken.launch(fail)
    with pytest.raises(RuntimeError, match="failed") as info:
        broken.synchronize()
    assert isinstance(info.value.__cause__, ValueError)


def test_capabilities(sim):
    assert sim.supports_async_output and sim.is_available() and sim.device_count() == 1
    assert sim.torch_device() == torch.device("cpu")
    assert not sim.empty_pinned((2,), torch.float32).is_pinned()
