"""Layer-wise offload on the simulated device (``diffrt_simdevice``): copies
land late there, so a block that ran before its copy's event would draw
wrong pixels; the outputs must equal the run without offload bit for bit.
The blocks' parameters sit in at most ``prefetch + 1`` device slots, their
host copies are page-locked, reused across calls and unlocked when the
offload goes; what is refused on CPU and in combinations."""

from __future__ import annotations

import gc

import pytest
import torch
from diffrt_simdevice.platform import SimDevicePlatform
from pipeline_steps import stepped

from diffrt.engine import EngineConfig, EngineConfigError
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.offload import LayerwiseOffload, transformer_blocks
from diffrt.engine.weights.resident import resident_bytes
from diffrt.platforms.cpu import CpuPlatform

CPU = torch.device("cpu")


class Stack(torch.nn.Module):
    """A toy transformer: an input projection, six blocks of two sizes, an output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64 if i % 2 else 48), torch.nn.GELU(),
                                torch.nn.Linear(64 if i % 2 else 48, 32)) for i in range(6))
        self.proj_out = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        for block in self.blocks:
            h = h + block(h)
        return self.proj_out(h)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_blocks_stream_through_prefetch_plus_one_slots_and_give_the_same_bits(prefetch):
    platform = SimDevicePlatform(copy_delay_s=0.003)
    x = torch.randn(4, 16)
    model = Stack()
    expected = model(x)
    offload = LayerwiseOffload(transformer_blocks(model), platform, CPU, prefetch=prefetch)
    slots = {slot.untyped_storage().data_ptr() for slot in offload.slots}
    assert len(slots) == prefetch + 1
    seen: set[int] = set()

    def watch(module, args):
        seen.update(p.untyped_storage().data_ptr() for p in module.parameters())
    for block in model.blocks:
        block.register_forward_pre_hook(watch)  # after the offload's own: sees where it points
    hosts = [block.host.data_ptr() for block in offload.blocks]
    for _ in range(3):  # the wrap-around prefetch of the next call too
        assert torch.equal(model(x), expected)
    assert seen <= slots  # every block ran from a device slot
    assert offload.device_bytes == (prefetch + 1) * max(b.nbytes for b in offload.blocks)
    assert [block.host.data_ptr() for block in offload.blocks] == hosts  # reused, not remade
    assert all(platform.is_page_locked(block.host) for block in offload.blocks)
    locked = len(platform._registered)
    assert locked >= len(offload.blocks)
    platform.synchronize()  # the next call's first blocks are still in flight
    del offload, model, block, watch
    gc.collect()
    assert len(platform._registered) == locked - len(hosts)  # unlocked with the offload


def test_without_events_the_copies_are_synchronous():
    """A platform whose events are unusable: each block is copied before it
    runs, on the calling thread, and the bits are the same."""
    class NoEvents(SimDevicePlatform):
        def record_device_event(self, stream=None):
            return None

    x = torch.randn(2, 16)
    model = Stack()
    expected = model(x)
    offload = LayerwiseOffload(transformer_blocks(model), NoEvents(copy_delay_s=0.0), CPU)
    assert offload._stream is None
    assert torch.equal(model(x), expected)


def test_a_skipped_block_is_copied_again_when_it_next_runs():
    """A step cache skips blocks: the slots go to the blocks that run."""
    platform = SimDevicePlatform(copy_delay_s=0.002)
    model = Stack()
    x = torch.randn(3, 16)
    h = model.proj_in(x)
    plain = [h := h + model.blocks[i](h) for i in (0, 3, 4, 1)]
    LayerwiseOffload(transformer_blocks(model), platform, CPU)
    h = model.proj_in(x)
    for i, want in zip((0, 3, 4, 1), plain, strict=True):
        h = h + model.blocks[i](h)
        assert torch.equal(h, want)


def test_tiny_flux_with_offloaded_blocks_draws_the_same_bits_in_both_modes():
    """The pipeline's own request-mode forward and its step protocol, the
    device holding the non-block weights and two blocks."""
    spec = resolve_model_spec("tiny-flux")
    requests = [DiffusionRequest("a red square", request_id=f"r{seed}", sampling_params=SamplingParams(
        seed=seed, num_inference_steps=4, height=64, width=64)) for seed in (1, 2)]
    plain = load_pipeline(spec, device=CPU, dtype=torch.float32)
    expected = plain.forward(DiffusionRequestBatch(requests))
    pipeline = load_pipeline(spec, device=CPU, dtype=torch.float32)
    full = resident_bytes(pipeline.transformer)["cpu"]
    offload = pipeline.enable_layerwise_offload(SimDevicePlatform(copy_delay_s=0.002), prefetch=1)
    blocks = transformer_blocks(pipeline.transformer)
    hosts = {block.host.untyped_storage().data_ptr() for block in offload.blocks}
    peaks = []

    def device_held(module, args):
        """At each block's start: the bytes of the storages the transformer's
        parameters point at outside the blocks' host buffers (the device's)."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in pipeline.transformer.parameters()}
        peaks.append(sum(n for ptr, n in storages.items() if ptr not in hosts))
        assert all(p.untyped_storage().data_ptr() not in hosts for p in module.parameters())

    for block in blocks:
        block.register_forward_pre_hook(device_held)  # after the offload's own
    for got, want in zip(pipeline.forward(DiffusionRequestBatch(requests)), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(stepped(pipeline, requests), expected, strict=True):
        assert torch.equal(got, want)
    # never more on the device than the non-block parameters and two blocks' slots
    rest = resident_bytes(pipeline.transformer, skip=blocks)["cpu"]
    assert offload.device_bytes == 2 * max(b.nbytes for b in offload.blocks)
    assert peaks and max(peaks) <= rest + offload.device_bytes
    assert max(peaks) < full  # and less than the whole transformer


def test_layerwise_offload_is_refused_where_it_cannot_run():
    with pytest.raises(EngineConfigError, match="on cpu the host is the device") as info:
        EngineConfig(model="tiny-flux", offload="layerwise").executor_config(platform=CpuPlatform())
    assert info.value.field == "offload"
    EngineConfig(model="tiny-flux", offload="layerwise").executor_config(
        platform=SimDevicePlatform())
    for kw, reason in [(dict(quantization="int8"), "use offload='model' with it"),
                       (dict(compile=True), "use compile or offload"),
                       (dict(cfg_parallel_size=2), "runs on one rank")]:
        with pytest.raises(EngineConfigError, match=reason):
            EngineConfig(model="tiny-flux", offload="layerwise", **kw)


@pytest.mark.parametrize("rows, cache", [("packed", None), ("by_size", "teacache")])
def test_paths_that_call_a_blocks_layers_directly_wait_for_its_copy(rows, cache):
    """Flux's packed rows call each block's layers, not the block; TeaCache
    reads the first block's norm before the block runs. Both must see the
    block's own weights: mixed sizes in one step, with and without offload."""
    spec = resolve_model_spec("tiny-flux")
    sizes = [(64, 64), (96, 64), (64, 96)]
    requests = [DiffusionRequest("a red square", request_id=f"r{i}", sampling_params=SamplingParams(
        seed=i, num_inference_steps=5, height=h, width=w, cache=cache,
        cache_threshold=0.6 if cache else None)) for i, (h, w) in enumerate(sizes)]
    plain = load_pipeline(spec, device=CPU, dtype=torch.float32)
    plain.mixed_rows = rows
    expected = stepped(plain, requests)
    pipeline = load_pipeline(spec, device=CPU, dtype=torch.float32)
    pipeline.mixed_rows = rows
    pipeline.enable_layerwise_offload(SimDevicePlatform(copy_delay_s=0.002), prefetch=1)
    for _ in range(2):  # the second time after the wrap-around prefetch of the first
        for got, want in zip(stepped(pipeline, requests), expected, strict=True):
            assert torch.equal(got, want)


class LateBlock(torch.nn.Module):
    """A residual linear block whose compute is a kernel queued on the
    simulated device's current stream, reading the weights it was launched
    with when it runs (as a GPU kernel reads its pointers), a few ms later."""

    def __init__(self, platform: SimDevicePlatform, width: int):
        super().__init__()
        self.platform = platform
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weight = torch.empty_like(x), self.weight.detach()  # the pointer, not the name

        def kernel() -> None:
            torch.add(x, x @ weight.t(), out=out)
        self.platform.launch(kernel, delay_s=0.003)
        return out


@pytest.mark.parametrize("drop_wait", [False, True])
def test_a_slot_is_not_overwritten_before_the_kernels_reading_it_ran(monkeypatch, drop_wait):
    """With compute queued on the device, a copy into a slot must wait for
    the event recorded after the slot's previous block: without that wait
    (``wait_event`` taken out) the late kernels read the next block's weights."""
    platform = SimDevicePlatform(copy_delay_s=0.0005)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(LateBlock(platform, 32) for _ in range(6))
    x = torch.randn(4, 32)

    def run() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h)
        platform.synchronize()
        return h

    expected = run()
    LayerwiseOffload(list(blocks), platform, CPU, prefetch=1)
    if drop_wait:
        monkeypatch.setattr(platform, "wait_event", lambda stream, event: None)
    results = [run() for _ in range(2)]
    same = all(torch.equal(got, expected) for got in results)
    assert same is not drop_wait
