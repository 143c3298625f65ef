"""Sleep and wake (docs/rollouts.md). On the simulated device
(``diffrt_simdevice``: page-locked memory is tracked by address) a level-1
sleep moves every weight into page-locked host memory and counts the bytes
the device gave up; waking brings them back and the pictures are
bit-identical; a level-2 sleep drops the transformer and waking reads it
from the folder, bit-identical too. The engine's side (requests wait while
it sleeps; CPU: a no-op for memory) is in ``test_weight_updates.py``."""

from __future__ import annotations

import pytest
import torch
from diffrt_simdevice.platform import SimDevicePlatform

from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.sleep import SleepingWeights

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(resolve_model_spec("tiny-flux"), device=CPU, dtype=torch.float32)


def draw(pipeline) -> torch.Tensor:
    request = DiffusionRequest("a red square", request_id="r", sampling_params=SamplingParams(
        seed=1, num_inference_steps=2, height=64, width=64))
    [image] = pipeline.forward(DiffusionRequestBatch([request]))
    return image


def weights(pipeline, only: str | None = None):
    return [t for name, m in pipeline.weight_modules().items() if only in (None, name)
            for t in [*m.parameters(), *m.buffers()]]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_and_wake_restores_it_bit_for_bit(pipeline, level):
    platform = SimDevicePlatform(copy_delay_s=0.0)
    before = draw(pipeline)
    modules = pipeline.weight_modules()
    total = sum(nbytes(t) for t in weights(pipeline))
    transformer = sum(nbytes(t) for t in weights(pipeline, "transformer"))
    asleep = SleepingWeights(modules, platform, CPU, level, pipeline.spec.folder)
    assert asleep.freed_bytes == total
    if level == 1:
        assert asleep.pinned_bytes == total and not asleep.reloads
        assert all(platform.is_page_locked(t) for t in weights(pipeline) if t.numel())
    else:  # the transformer is gone, the rest waits in page-locked memory
        assert asleep.pinned_bytes == total - transformer and asleep.reloads
        assert all(p.numel() == 0 for p in modules["transformer"].parameters())
    assert asleep.wake() == total
    assert not any(platform.is_page_locked(t) for t in weights(pipeline) if t.numel())
    assert torch.equal(draw(pipeline), before)


def test_on_the_cpu_sleep_frees_nothing(pipeline):
    """No page-locked memory: the host is the device, nothing moves."""
    from diffrt.platforms.cpu import CpuPlatform

    ptrs = [t.data_ptr() for t in weights(pipeline)]
    asleep = SleepingWeights(pipeline.weight_modules(), CpuPlatform(), CPU, 2,
                             pipeline.spec.folder)
    assert asleep.freed_bytes == 0 and asleep.wake() == 0
    assert [t.data_ptr() for t in weights(pipeline)] == ptrs
