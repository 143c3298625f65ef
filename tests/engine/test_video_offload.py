"""Offload on video: tiny-wan's two experts (Wan 2.2's high- and low-noise
transformers) on the simulated device (``diffrt_simdevice``), where a copy
lands late and a block or expert that computed before its copy's event would
draw wrong frames. Layer-wise offload streams both experts' blocks through
the same ``prefetch + 1`` slots; model offload moves each expert alone (one
on the device at a time). Both give the frames of the run without offload,
bit for bit, alone and step-batched with another frame count and size; the
weight estimate counts ``transformer_2``."""

from __future__ import annotations

import pytest
import torch
from diffrt_simdevice.platform import SimDevicePlatform
from pipeline_steps import stepped
from test_model_offload import on_host, on_simulated_device  # noqa: F401 (a fixture)

from diffrt.engine import EngineConfig
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.budget import components, device_bytes

pytest.importorskip("diffusers")

CPU = torch.device("cpu")


def clip_request(seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(f"a red fox {seed}", request_id=f"r{seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


#: a 9-frame 64^2 clip and a 5-frame 32 x 48 one: 4 steps cross the experts' boundary
REQUESTS = [clip_request(1), clip_request(2, num_frames=5, height=32, width=48)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def expected():
    """The frames without offload: request mode alone, and stepped together
    in one padded call a step."""
    plain = load_pipeline("tiny-wan")
    return plain.forward(DiffusionRequestBatch(REQUESTS[:1]))[0], stepped(plain, REQUESTS)


def test_layerwise_offload_streams_both_experts_blocks_through_shared_slots(expected):
    alone, together = expected
    pipeline = load_pipeline("tiny-wan")
    assert pipeline.mixed_rows == "padded"
    offload = pipeline.enable_layerwise_offload(SimDevicePlatform(copy_delay_s=0.002),
                                                prefetch=1)
    experts = (pipeline.transformer, pipeline.transformer_2)
    assert [b.module for b in offload.blocks] == [*experts[0].blocks, *experts[1].blocks]
    hosts = {block.host.untyped_storage().data_ptr() for block in offload.blocks}
    ran: list[int] = []

    def from_a_slot(module, args):  # after the offload's own hook
        assert all(p.untyped_storage().data_ptr() not in hosts for p in module.parameters())
        ran.append(id(module))

    for expert in experts:
        for block in expert.blocks:
            block.register_forward_pre_hook(from_a_slot)
    assert torch.equal(pipeline.forward(DiffusionRequestBatch(REQUESTS[:1]))[0], alone)
    for got, want in zip(stepped(pipeline, REQUESTS), together, strict=True):
        assert torch.equal(got, want)
    assert {id(b) for e in experts for b in e.blocks} <= set(ran)  # both experts streamed
    assert offload.device_bytes == 2 * max(b.nbytes for b in offload.blocks)


def test_model_offload_keeps_one_expert_on_the_device_at_a_time(expected):
    alone, together = expected
    pipeline = load_pipeline("tiny-wan")
    offload = pipeline.enable_model_offload(SimDevicePlatform(copy_delay_s=0.002))
    pipeline.place_weights(CPU, on_host=tuple(offload.managed))
    assert {"transformer", "transformer_2"} <= set(offload.managed)
    seen: list[tuple[str, list[str]]] = []

    def watch(name):
        def hook(module, args):
            seen.append((name, [n for n, p in offload.managed.items() if not on_host(p)]))
        return hook

    for name in ("transformer", "transformer_2"):
        getattr(pipeline, name).blocks[0].register_forward_pre_hook(watch(name))
    assert torch.equal(pipeline.forward(DiffusionRequestBatch(REQUESTS[:1]))[0], alone)
    for got, want in zip(stepped(pipeline, REQUESTS), together, strict=True):
        assert torch.equal(got, want)
    assert {name for name, _ in seen} == {"transformer", "transformer_2"}
    assert all(on_device == [name] for name, on_device in seen)  # the running expert alone


def test_the_estimate_counts_the_second_expert():
    parts = components(resolve_model_spec("tiny-wan").folder)
    assert {"transformer", "transformer_2", "vae", "text_encoder"} <= set(parts)
    sizes = {name: part.bytes("none", 4) for name, part in parts.items()}
    base = {"quantization": "none", "text_encoder_quantization": "none", "offload": "none",
            "offload_text_encoders": False, "offload_prefetch": 1}
    assert device_bytes(parts, 4, base) == sum(sizes.values())
    assert device_bytes(parts, 4, {**base, "offload": "model"}) == max(sizes.values())
    int8 = device_bytes(parts, 4, {**base, "quantization": "int8"})
    first_only = sizes["transformer"] - parts["transformer"].bytes("int8", 4)
    assert sum(sizes.values()) - int8 > 1.5 * first_only  # both experts converted
    layerwise = device_bytes(parts, 4, {**base, "offload": "layerwise"})
    prefetch_2 = device_bytes(parts, 4, {**base, "offload": "layerwise", "offload_prefetch": 2})
    block = prefetch_2 - layerwise  # one more slot: the slots are shared by both experts
    assert layerwise < sum(sizes.values()) and 0 < block < sizes["transformer_2"]


def test_offload_on_video_is_accepted_where_it_runs():
    sim = SimDevicePlatform()
    for offload in ("layerwise", "model"):
        EngineConfig(model="tiny-wan", offload=offload).executor_config(platform=sim)


@pytest.mark.usefixtures("on_simulated_device")
def test_through_the_engine_both_experts_are_offloaded(expected):
    """The runner's set-up under layer-wise offload (loaded into host
    memory, then each expert's non-block weights placed) and its weight
    count: each expert's blocks reported offloaded, the slots counted once;
    the frames those of the run without offload."""
    import numpy as np

    from diffrt.engine import DiffusionEngine
    from diffrt.engine.postprocess import quantize_images

    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-wan", executor_backend="inproc", warmup=False,
            offload="layerwise")) as engine:
        out = engine.generate(REQUESTS[0])
        held = engine.weight_bytes
    assert out.ok, out.error
    frames = np.stack([np.asarray(f) for f in out.frames[0]])
    assert np.array_equal(frames, quantize_images(expected[0])[0].numpy())
    assert set(held.offloaded) == {"transformer", "transformer_2"}
    # two blocks an expert, of one size: the 2 slots are about half the 4
    # streamed blocks, counted once for both experts (twice: about the total)
    streamed = sum(held.offloaded.values())
    total = sum(part["cpu"] for part in held.components.values())
    assert total - streamed < held.on_device < total - streamed // 4
