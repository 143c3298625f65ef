"""On a real CUDA/ROCm GPU only: the known-correct async D2H pattern end to end."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def test_pinned_side_stream_copy_is_complete_after_its_event():
    from diffrt.platforms.cuda import CudaPlatform
    from diffrt.platforms.pinned_pool import PinnedBufferPool

    p = CudaPlatform()
    assert p.pinned_memory_available()
    src = torch.randn(16 << 20, device="cuda")  # 64 MiB, produced on the compute stream
    pool = PinnedBufferPool(p)
    slot = pool.acquire(src.shape, src.dtype)
    assert slot.tensor.is_pinned()
    side = p.new_side_stream()
    p.wait_event(side, p.record_device_event())
    p.copy_async(slot.tensor, src, side)
    done = p.record_device_event(side)
    p.event_synchronize(done)
    assert torch.equal(slot.tensor, src.cpu())
    pool.release(slot, done)
    assert pool.acquire(src.shape, src.dtype) is slot
