"""On a real CUDA/ROCm GPU only: the async D2H pattern, the page-locked output
arena, and the engine serving through it."""

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


def test_trim_memory_gives_the_cached_blocks_back():
    """What the worker's trim rule reads and does (engine/memory_trim.py): the
    reservation stays after a tensor is freed and goes once trimmed."""
    from diffrt.platforms.cuda import CudaPlatform

    p = CudaPlatform()
    p.trim_memory()
    before = p.held_memory_bytes()
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    kept = p.held_memory_bytes()
    assert before is not None and kept is not None and kept >= before + (256 << 20)
    p.trim_memory()
    after = p.held_memory_bytes()
    assert after is not None and after <= before


def test_the_output_arena_is_page_locked_and_receives_async_copies():
    """The serving path's arena: registered (is_pinned), written by an async
    side-stream copy that is complete after wait_copied, unregistered after."""
    from diffrt.platforms.cuda import CudaPlatform
    from diffrt.runtime.shm_transport import Arena

    p = CudaPlatform()
    arena = Arena.create(64 << 20)
    try:
        handle = p.register_host_memory(arena.bytes_view(0, arena.size))
        assert handle is not None
        dst = arena.tensor_view(0, torch.float32, [16 << 20])
        assert dst.is_pinned()
        src = torch.randn(16 << 20, device="cuda")
        side = p.new_side_stream()
        p.wait_event(side, p.record_device_event())
        p.copy_async(dst, src, side)
        p.wait_copied(p.record_device_event(side), side)
        assert torch.equal(dst, src.cpu())
        p.unregister_host_memory(handle)
        assert not dst.is_pinned()
    finally:
        arena.close()


def test_engine_serves_the_tiny_model_with_async_output_identical_to_sync():
    """The whole serving path on the GPU: worker process, page-locked arena,
    output thread on its side stream; async and sync outputs bit-identical."""
    from diffrt.engine import DiffusionEngine, EngineConfig
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams

    engines = [DiffusionEngine.make_engine(EngineConfig(model="tiny-flux", async_output=flag))
               for flag in (True, False)]
    try:
        for seed in range(6):
            params = SamplingParams(height=256, width=256, num_inference_steps=3, seed=seed,
                                    output_type="pt")
            outs = [e.generate(DiffusionRequest(prompt="a red fox", request_id=f"{k}-{seed}",
                                                sampling_params=params))
                    for k, e in enumerate(engines)]
            assert all(o.ok for o in outs), [o.error for o in outs]
            assert torch.equal(outs[0].output, outs[1].output)
    finally:
        for e in engines:
            e.close()


def test_a_failed_host_registration_leaves_the_next_launch_clean():
    """Issue 28 item 2 on the real runtime (``diffrt env --check`` runs the same)."""
    from diffrt.cli.gpu_checks import host_register_error
    from diffrt.platforms.cuda import CudaPlatform

    result = host_register_error(CudaPlatform())
    assert result["ok"] and result["launch_after_failure_ok"], result


def test_each_rank_computes_streams_and_events_on_its_own_device():
    """Issue 28 item 5 on the real runtime, one child process per rank."""
    from diffrt.cli.gpu_checks import rank_devices
    from diffrt.platforms.cuda import CudaPlatform

    result = rank_devices(CudaPlatform())
    assert result["ok"], result
