"""Model offload on the simulated device (``diffrt_simdevice``): whole
components live in page-locked host buffers and move to the device when
they run. Copies land late there, so a component that computed before its
copy's event would draw wrong pixels: outputs must equal the run without
offload bit for bit — and do not when the wait is taken out. At most one
managed component points at device tensors at a time; kept components never
move; what the estimate says it needs; what is refused."""

from __future__ import annotations

import pytest
import torch
from diffrt_simdevice.platform import SimDevicePlatform
from pipeline_steps import stepped

from diffrt.engine import EngineConfig, EngineConfigError
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.budget import components, device_bytes
from diffrt.engine.weights.model_offload import ModelOffload
from diffrt.platforms.cpu import CpuPlatform

CPU = torch.device("cpu")


def toy() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                  torch.nn.Linear(64, 16))
    denoiser = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                   torch.nn.Linear(32, 16))
    decoder = torch.nn.Sequential(torch.nn.Linear(16, 8))
    return {"encoder": encoder, "denoiser": denoiser, "decoder": decoder}


def run(parts: dict[str, torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    h = parts["encoder"](x)
    steps = []
    for _ in range(3):
        h = h + parts["denoiser"](h)
        steps.append(h)
    return [*steps, parts["decoder"](h)]


def on_host(part) -> bool:
    """Whether every tensor of the managed component points into its host buffer."""
    lo = part.host.data_ptr()
    hi = lo + part.host.numel()
    return all(lo <= s.get().data_ptr() < hi for s in part.slots)


def test_components_move_on_when_they_run_and_give_the_same_bits():
    x = torch.randn(4, 16)
    parts = toy()
    expected = run(parts, x)
    platform = SimDevicePlatform(copy_delay_s=0.004)
    offload = ModelOffload(parts, platform, CPU)
    assert all(on_host(p) for p in offload.managed.values())
    assert all(platform.is_page_locked(p.host) for p in offload.managed.values())
    seen = []

    def watch(name):
        def hook(module, args):
            seen.append((name, [n for n, p in offload.managed.items() if not on_host(p)]))
        return hook

    for name, module in parts.items():
        module.register_forward_pre_hook(watch(name))  # after the offload's own hook
    for _ in range(2):
        for got, want in zip(run(parts, x), expected, strict=True):
            assert torch.equal(got, want)
    # each component alone on the device while it runs
    assert all(on_device == [name] for name, on_device in seen)
    # the denoiser stays for its three steps: one load per run
    assert offload.loads == {"encoder": 2, "denoiser": 2, "decoder": 2}
    assert offload.largest_bytes == max(p.host_bytes for p in offload.managed.values())


def test_without_the_wait_the_late_copies_show_as_wrong_pixels(monkeypatch):
    """What makes the test above able to fail: the simulated copies land late."""
    x = torch.randn(4, 16)
    parts = toy()
    expected = run(parts, x)
    platform = SimDevicePlatform(copy_delay_s=0.02)
    monkeypatch.setattr(platform, "wait_for_compute", lambda event: None)
    ModelOffload(parts, platform, CPU)
    got = run(parts, x)
    platform.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_kept_components_stay_and_send_the_managed_ones_back():
    x = torch.randn(4, 16)
    parts = toy()
    expected = run(parts, x)
    kept_ptrs = {id(p): p.data_ptr() for p in parts["denoiser"].parameters()}
    offload = ModelOffload(parts, SimDevicePlatform(copy_delay_s=0.002), CPU,
                           kept=("denoiser",))
    assert set(offload.managed) == {"encoder", "decoder"}
    for got, want in zip(run(parts, x), expected, strict=True):
        assert torch.equal(got, want)
    assert {id(p): p.data_ptr() for p in parts["denoiser"].parameters()} == kept_ptrs
    # the decoder ran last and is still on; the denoiser's next call sends it back
    assert offload.current is offload.managed["decoder"]
    parts["denoiser"](x)
    assert offload.current is None and all(on_host(p) for p in offload.managed.values())


def test_tied_weights_stay_tied():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.weight = a.weight
    model = torch.nn.Sequential(a, torch.nn.ReLU(), b)
    x = torch.randn(2, 8)
    want = model(x)
    offload = ModelOffload({"m": model, "other": torch.nn.Linear(8, 8)},
                           SimDevicePlatform(copy_delay_s=0.002), CPU)
    assert torch.equal(model(x), want)
    assert model[0].weight is model[2].weight
    assert offload.managed["m"].nbytes < 3 * 8 * 8 * 4  # one copy of the tied weight


def test_tiny_flux_with_offloaded_components_draws_the_same_bits_in_both_modes():
    """Loaded into host memory first, as the runner does under offload, then
    placed: text encoders, transformer and VAE each on the device alone."""
    spec = resolve_model_spec("tiny-flux")
    requests = [DiffusionRequest("a red square", request_id=f"r{seed}",
                                 sampling_params=SamplingParams(
                                     seed=seed, num_inference_steps=4, height=64, width=64))
                for seed in (1, 2)]
    plain = load_pipeline(spec, device=CPU, dtype=torch.float32)
    expected = plain.forward(DiffusionRequestBatch(requests))
    pipeline = load_pipeline(spec, device=CPU, dtype=torch.float32)
    offload = pipeline.enable_model_offload(SimDevicePlatform(copy_delay_s=0.002))
    pipeline.place_weights(CPU, on_host=tuple(offload.managed))
    assert set(offload.managed) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    for got, want in zip(pipeline.forward(DiffusionRequestBatch(requests)), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(stepped(pipeline, requests), expected, strict=True):
        assert torch.equal(got, want)
    # the transformer stays on for all steps of a run and moves off for its
    # decode; the encoders run for the batch, then for each prepared state
    # (no prompt cache on a pipeline loaded by hand)
    assert offload.loads["transformer"] == 2 and offload.loads["text_encoder_2"] == 3


def test_offload_text_encoders_keeps_the_transformer_and_vae_on_the_device():
    spec = resolve_model_spec("tiny-sd3")
    request = DiffusionRequest("a red square", request_id="r", sampling_params=SamplingParams(
        seed=3, num_inference_steps=3, height=64, width=64))
    expected = load_pipeline(spec, device=CPU).forward(DiffusionRequestBatch([request]))[0]
    pipeline = load_pipeline(spec, device=CPU)
    before = {id(p): p.data_ptr() for p in pipeline.transformer.parameters()}
    offload = pipeline.enable_model_offload(SimDevicePlatform(copy_delay_s=0.002),
                                            kept=("transformer", "vae"))
    assert set(offload.managed) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    assert torch.equal(pipeline.forward(DiffusionRequestBatch([request]))[0], expected)
    assert {id(p): p.data_ptr() for p in pipeline.transformer.parameters()} == before
    assert offload.current is None  # the transformer's first step sent the encoders back


def test_the_estimate_counts_the_largest_component_under_model_offload():
    spec = resolve_model_spec("tiny-flux")
    parts = components(spec.folder)
    sizes = {name: part.bytes("none", 4) for name, part in parts.items()}
    base = {"quantization": "none", "text_encoder_quantization": "none", "offload": "none",
            "offload_text_encoders": False, "offload_prefetch": 1}
    assert device_bytes(parts, 4, base) == sum(sizes.values())
    assert device_bytes(parts, 4, {**base, "offload": "model"}) == max(sizes.values())
    texts = [n for name, n in sizes.items() if name.startswith("text_encoder")]
    assert device_bytes(parts, 4, {**base, "offload_text_encoders": True}) == (
        sum(sizes.values()) - sum(texts) + max(texts))
    layerwise = device_bytes(parts, 4, {**base, "offload": "layerwise"})
    assert layerwise < sum(sizes.values())


def test_model_offload_is_refused_where_it_cannot_run():
    with pytest.raises(EngineConfigError, match="on cpu the host is the device") as info:
        EngineConfig(model="tiny-flux", offload="model").executor_config(platform=CpuPlatform())
    assert info.value.field == "offload"
    EngineConfig(model="tiny-flux", offload="model", quantization="int8").executor_config(
        platform=SimDevicePlatform())
    for kw, reason in [(dict(compile=True), "use compile or offload"),
                       (dict(cfg_parallel_size=2), "runs on one rank")]:
        with pytest.raises(EngineConfigError, match=reason):
            EngineConfig(model="tiny-flux", offload="model", **kw)


def test_the_budget_counts_offload_and_names_it_where_offload_runs():
    """On the simulated device (host is not device) a budget under the loaded
    weights names the offloads that fit, and a setting it names is accepted."""
    sim = SimDevicePlatform()
    parts = components(resolve_model_spec("tiny-flux").folder)
    largest = max(part.bytes("none", 4) for part in parts.values())
    budget = largest + 1000
    with pytest.raises(EngineConfigError, match="over the budget") as info:
        EngineConfig(model="tiny-flux", device_memory_budget=budget).executor_config(
            platform=sim)
    assert "offload='model'" in str(info.value)
    EngineConfig(model="tiny-flux", device_memory_budget=budget,
                 offload="model").executor_config(platform=sim)
    # layer-wise offload needs less than the whole transformer on the device
    whole = sum(part.bytes("none", 4) for part in parts.values())
    EngineConfig(model="tiny-flux", device_memory_budget=whole - 1000,
                 offload="layerwise").executor_config(platform=sim)


def test_settings_that_cannot_apply_are_refused_naming_the_field():
    with pytest.raises(EngineConfigError, match="applies to offload='layerwise' only") as info:
        EngineConfig(model="tiny-flux", offload="model", offload_prefetch=2)
    assert info.value.field == "offload_prefetch"

    class Fp8Device(SimDevicePlatform):
        def fp8_matmul_supported(self) -> bool:
            return True

    with pytest.raises(EngineConfigError, match="take bfloat16 weights") as info:
        EngineConfig(model="tiny-flux", quantization="fp8",
                     dtype="float16").executor_config(platform=Fp8Device())
    assert info.value.field == "quantization"


@pytest.fixture
def on_simulated_device():
    """This process's platform is the simulated device (the in-process
    executor's worker runs on it), the one resolved before afterwards."""
    from diffrt import platforms

    platform = SimDevicePlatform(copy_delay_s=0.001)
    platforms.set_current_platform(platform, "the test runs on the simulated device")
    yield platform
    platforms.reset_platform()


def test_lora_adapters_and_batches_run_on_offloaded_weights(on_simulated_device, tmp_path):
    """Through the engine (step mode, three requests sharing steps, one with
    an adapter): layer-wise offload and model offload give the bits of the run
    without offload; model offload over int8 weights those of int8 alone."""
    import numpy as np
    from lora_files import make_adapter

    from diffrt.engine import DiffusionEngine
    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES

    adapter = make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", tmp_path / "a",
                           targets=LORA_TARGET_MODULES, rank=4, seed=1)
    requests = [DiffusionRequest("a red square", sampling_params=SamplingParams(
        seed=seed, num_inference_steps=4, height=64, width=64, loras=loras))
        for seed, loras in ((1, {"a": 1.0}), (2, None), (1, None))]

    offloaded: dict[str, set[str]] = {}

    def images(**kw) -> list[np.ndarray]:
        config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                              max_num_seqs=3, lora_modules={"a": adapter}, warmup=False, **kw)
        with DiffusionEngine.make_engine(config) as engine:
            outputs = engine.generate(requests)
            offloaded[kw.get("offload", "none")] = set(engine.weight_bytes.offloaded)
        assert all(o.ok for o in outputs), [o.error for o in outputs]
        return [np.asarray(o.images[0]) for o in outputs]

    plain, int8 = images(), images(quantization="int8")
    assert not np.array_equal(plain[0], plain[2])  # the adapter changes its request's image
    for got, want in ((images(offload="layerwise"), plain), (images(offload="model"), plain),
                      (images(offload="model", quantization="int8"), int8)):
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)
    assert offloaded == {"none": set(), "layerwise": {"transformer"},
                         "model": {"transformer", "vae", "text_encoder", "text_encoder_2"}}


def test_a_gguf_transformer_moves_with_model_offload(tmp_path):
    """GGUF weights (diffusers' GGUFParameter, a tensor subclass carrying its
    quantisation type) move as subclasses do and keep their type: the same
    bits as the GGUF folder without offload."""
    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.models.gguf_file import gguf_folder

    folder = gguf_folder(embedded_folder("tiny-flux"), str(tmp_path / "gguf"))
    request = [DiffusionRequest("a red square", request_id="r", sampling_params=SamplingParams(
        seed=1, num_inference_steps=3, height=64, width=64))]
    want = load_pipeline(str(folder)).forward(DiffusionRequestBatch(request))[0]
    pipeline = load_pipeline(str(folder))
    offload = pipeline.enable_model_offload(SimDevicePlatform(copy_delay_s=0.002))
    pipeline.place_weights(CPU, on_host=tuple(offload.managed))
    assert torch.equal(pipeline.forward(DiffusionRequestBatch(request))[0], want)
    weight = pipeline.transformer.transformer_blocks[0].attn.to_q.weight
    assert type(weight).__name__ == "GGUFParameter" and weight.quant_type is not None
    assert offload.loads["transformer"] == 1


@pytest.mark.parametrize("settings, attribute", [
    ({"offload": "model"}, "model_offload"), ({"offload_text_encoders": True}, "model_offload"),
    ({"offload": "layerwise"}, "offload")])
def test_the_runner_offloads_to_its_device_not_where_it_loaded(monkeypatch, settings,
                                                               attribute):
    """Under offload the worker loads into host memory first; the offloads
    must copy to the worker's device all the same. ``cpu:0`` stands for it
    (it compares unequal to the host's ``cpu``, where the model loaded)."""
    from diffrt.engine import pipeline_runner
    from diffrt.engine.runner_messages import RunnerSettings
    from diffrt.engine.settings import ModelConfig

    target = torch.device("cpu", 0)
    monkeypatch.setattr(pipeline_runner, "rank_device", lambda platform, rank: target)
    runner = pipeline_runner.PipelineRunner(
        RunnerSettings(resolve_model_spec("tiny-flux"), model=ModelConfig(
            model="tiny-flux", **settings)), rank=0, world_size=1,
        platform=SimDevicePlatform())
    assert runner.pipeline.device == target
    assert getattr(runner, attribute).device == target
