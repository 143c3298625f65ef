"""Pinned pool: a slot is reused only after its copy event completed."""

from __future__ import annotations

import pytest
import torch

from diffrt.platforms.cpu import CpuPlatform
from diffrt.platforms.pinned_pool import PinnedBufferPool


class ManualEvent:
    def __init__(self) -> None:
        self.done = False
        self.synced = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced = self.done = True


def test_cpu_pool_reuses_ordinary_buffers():
    pool = PinnedBufferPool(CpuPlatform())
    slot = pool.acquire((2, 3), torch.float32)
    assert slot.tensor.shape == (2, 3) and not slot.tensor.is_pinned()
    pool.release(slot, CpuPlatform().record_device_event())  # None on CPU
    again = pool.acquire((6,), torch.float32)
    assert again is slot and pool.allocations == 1 and pool.reuses == 1


def test_slot_not_reused_while_its_copy_is_pending():
    pool = PinnedBufferPool(CpuPlatform())
    slot = pool.acquire((4,), torch.float32)
    event = ManualEvent()
    pool.release(slot, event)
    other = pool.acquire((4,), torch.float32)
    assert other is not slot  # pending copy: a new buffer
    assert other.tensor.data_ptr() != slot.tensor.data_ptr()
    event.done = True
    assert pool.acquire((4,), torch.float32) is slot
    assert len(pool) == 2


def test_held_slot_never_handed_out_twice():
    pool = PinnedBufferPool(CpuPlatform())
    a = pool.acquire((8,), torch.uint8)
    b = pool.acquire((8,), torch.uint8)
    assert a is not b


def test_smallest_fitting_buffer_reused_with_new_dtype():
    pool = PinnedBufferPool(CpuPlatform())
    big, small = pool.acquire((1024,), torch.uint8), pool.acquire((64,), torch.uint8)
    pool.release(big)
    pool.release(small)
    slot = pool.acquire((2, 16), torch.bfloat16)  # 64 bytes
    assert slot is small and slot.tensor.dtype == torch.bfloat16 and slot.tensor.shape == (2, 16)
    assert pool.acquire((100,), torch.uint8) is big
    assert pool.total_bytes == 1024 + 64


def test_at_cap_waits_for_oldest_pending_copy_instead_of_allocating():
    pool = PinnedBufferPool(CpuPlatform(), max_buffers=1)
    slot = pool.acquire((16,), torch.float32)
    event = ManualEvent()
    pool.release(slot, event)
    again = pool.acquire((16,), torch.float32)
    assert again is slot and event.synced and pool.allocations == 1


def test_at_cap_replaces_a_too_small_buffer():
    pool = PinnedBufferPool(CpuPlatform(), max_buffers=1)
    pool.release(pool.acquire((4,), torch.uint8))
    bigger = pool.acquire((400,), torch.uint8)
    assert bigger.capacity == 400 and len(pool) == 1


def test_double_release_refused():
    pool = PinnedBufferPool(CpuPlatform())
    slot = pool.acquire((1,), torch.float32)
    pool.release(slot)
    with pytest.raises(ValueError, match="twice"):
        pool.release(slot)
