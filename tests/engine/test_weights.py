"""Lower-precision weights (``quantization``, ``text_encoder_quantization``)
and ``device_memory_budget``: the bytes the quantised linears hold, counted
from their storages (a quantise-then-dequantise fake shows at its real
size); images within a stated PSNR of the unquantised ones on tiny-flux,
tiny-sd3 and tiny Qwen-Image-Edit; diffrt-shapes still draws its prompts;
LoRA adapters on a quantised base; batching; compile; what is refused."""

from __future__ import annotations

import math

import numpy as np
import PIL.Image
import pytest
import torch
from lora_files import make_adapter
from shape_checks import SCENES

from diffrt.demo import shapes
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, EngineConfigError
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES
from diffrt.engine.pipelines.load import load_pipeline
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.budget import FP8_STORAGE_SKIP, components
from diffrt.engine.weights.resident import resident_bytes
from diffrt.platforms.cpu import CpuPlatform

CPU = torch.device("cpu")
#: the least PSNR (dB) of an image against the unquantised one, per method,
#: at 8 steps: measured 45.6 / 42.6 dB (int8) and 34.4 / 24.8 dB (fp8-storage,
#: three mantissa bits) on tiny-flux / tiny-sd3, whose weights are random
MIN_PSNR = {"int8": 35.0, "fp8-storage": 20.0}
PICTURE = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def pixels(output) -> np.ndarray:
    assert output.ok, output.error
    return np.asarray(output.images[0])


def engine(model: str = "tiny-flux", **kw) -> DiffusionEngine:
    """In this process, without the start-up requests (nothing here reads
    the run-time estimate they calibrate)."""
    return DiffusionEngine.make_engine(EngineConfig(
        model=model, executor_backend="inproc", **{"warmup": False, **kw}))


# -- bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "fp8-storage"])
def test_quantised_linears_hold_at_most_0_30_of_their_float32_bytes(method):
    """Counted from the storages the weights sit in; the folder's estimate
    (what ``device_memory_budget`` is checked against before loading) is the
    measured transformer's to the byte."""
    spec = resolve_model_spec("tiny-flux")
    pipeline = load_pipeline(spec, device=CPU, dtype=torch.float32)
    linears = {name: m for name, m in pipeline.transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    before = {name: resident_bytes(m)["cpu"] for name, m in linears.items()}
    pipeline.quantize_weights(method)
    converted = [name for name in linears if method == "int8"
                 or not any(__import__("re").search(p, name) for p in FP8_STORAGE_SKIP)]
    assert len(converted) >= 0.8 * len(linears)
    after = {name: resident_bytes(linears[name])["cpu"] for name in converted}
    assert sum(after.values()) <= 0.30 * sum(before[name] for name in converted)
    for name in converted:  # each weight (its bias stays as loaded): one byte a value
        weight = torch.nn.Module()  # plus, for int8, a float32 scale and a zero point a row
        weight.register_parameter("w", linears[name].weight)
        rows, columns = linears[name].weight.shape
        per_row = columns + (5 if method == "int8" else 0)
        assert resident_bytes(weight)["cpu"] == rows * per_row, name
    estimate = components(spec.folder)
    assert resident_bytes(pipeline.transformer)["cpu"] == estimate["transformer"].bytes(method, 4)


def test_a_dequantised_copy_counts_at_its_real_size():
    """int8 values kept beside the float weight they were made from (a fake
    quantisation) count both: the measure is what memory holds."""
    layer = torch.nn.Linear(64, 64, bias=False)
    float_bytes = resident_bytes(layer)["cpu"]
    layer.register_buffer("q", layer.weight.detach().to(torch.int8))
    assert resident_bytes(layer)["cpu"] == float_bytes * 5 // 4
    view = torch.nn.Module()
    view.register_buffer("a", layer.weight.detach()[:32])  # a view: its storage once
    view.register_buffer("b", layer.weight.detach())
    assert resident_bytes(view)["cpu"] == float_bytes


# -- pixels --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_references():
    with engine(step_execution=True, max_num_seqs=2) as e:
        yield [pixels(e.generate(flux_request(seed))) for seed in (1, 2)]


def flux_request(seed: int, **kw) -> DiffusionRequest:
    return DiffusionRequest("a red square", sampling_params=SamplingParams(
        seed=seed, **{"num_inference_steps": 8, **kw}))


@pytest.mark.parametrize("method", ["int8", "fp8-storage"])
def test_a_step_batch_on_quantised_weights_stays_near_the_float_images(method, flux_references):
    """Two requests sharing each step (step mode, text encoders quantised as
    well), each within the method's PSNR of its unquantised run."""
    import concurrent.futures as cf

    with engine(step_execution=True, max_num_seqs=2, quantization=method,
                text_encoder_quantization=method) as e:
        assert e.weight_bytes is not None
        assert e.weight_bytes.methods == {"transformer": method, "vae": "none",
                                          "text_encoder": method, "text_encoder_2": method}
        with cf.ThreadPoolExecutor(2) as pool:
            images = list(pool.map(lambda s: pixels(e.generate(flux_request(s))), (1, 2)))
    for image, reference in zip(images, flux_references, strict=True):
        assert MIN_PSNR[method] <= psnr(image, reference) < math.inf


@pytest.mark.parametrize("model, method, request_", [
    ("tiny-sd3", "int8", DiffusionRequest("a blue circle", sampling_params=SamplingParams(
        seed=4, num_inference_steps=8))),
    ("tiny-sd3", "fp8-storage", DiffusionRequest("a blue circle", sampling_params=SamplingParams(
        seed=4, num_inference_steps=8))),
    ("tiny-qwen-image-edit", "int8", DiffusionRequest("make it blue", images=[PICTURE],
                                                      sampling_params=SamplingParams(
                                                          seed=5, num_inference_steps=8))),
])
def test_other_families_on_quantised_weights_stay_near_the_float_images(model, method, request_):
    """Request mode; SD3 (three text encoders, joint attention) and
    Qwen-Image-Edit (the Qwen2.5-VL encoder reads the image)."""
    with engine(model) as e:
        reference = pixels(e.generate(request_))
    with engine(model, quantization=method) as e:
        assert MIN_PSNR[method] <= psnr(pixels(e.generate(request_)), reference) < math.inf


def test_diffrt_shapes_still_draws_its_prompts_on_int8_weights():
    """6 prompts (held-out and seen), every attribute read back: the share
    right is at least the model card's held-out accuracy less 5 points."""
    import json

    from diffrt.engine.models.shipped import shipped_folder

    card = json.load(open(f"{shipped_folder('diffrt-shapes')}/evaluation.json"))["rows"][0]
    shipped = sum(card[a] for a in ("colour", "shape", "position", "background")) / 4
    scenes = SCENES[:6]
    with engine("diffrt-shapes", quantization="int8", text_encoder_quantization="int8") as e:
        images = [e.generate(DiffusionRequest(s.prompt, sampling_params=SamplingParams(seed=i)))
                  .images[0] for i, s in enumerate(scenes)]
    hits = shapes.tally(scenes, images)
    assert sum(hits.values()) / (4 * len(scenes)) >= shipped - 0.05, hits


def test_lora_adapters_apply_on_a_quantised_base(tmp_path):
    """The per-row LoRA hooks run on the int8 linears: the adapter changes
    the image as much as on float weights, and the int8 image with it is
    near the float one with it."""
    adapter = make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", tmp_path / "a",
                           targets=LORA_TARGET_MODULES, rank=4, seed=1)
    with_lora = flux_request(3, loras={"a": 1.0})
    images = {}
    for method in ("none", "int8"):
        with engine(step_execution=True, quantization=method, lora_modules={"a": adapter}) as e:
            images[method] = (pixels(e.generate(flux_request(3))), pixels(e.generate(with_lora)))
    (plain, lora), (q_plain, q_lora) = images["none"], images["int8"]
    assert psnr(plain, lora) < 30  # the adapter changes the picture
    assert psnr(q_plain, q_lora) < 30
    assert psnr(q_lora, lora) >= MIN_PSNR["int8"]


def test_quantised_weights_compile():
    """``compile`` runs on the quantised modules (torchao's tensor subclass
    under dynamo): the images equal the eager quantised run within 1/255."""
    import torch._dynamo

    request = flux_request(6, num_inference_steps=2, height=64, width=64)
    with engine(quantization="int8") as e:
        eager = pixels(e.generate(request))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with engine(quantization="int8", compile=True,
                compile_backend="aot_eager") as e:  # one shape: one compilation
        compiled = pixels(e.generate(request))
    # dynamo compiled graphs (no silent fall back to eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert np.abs(eager.astype(int) - compiled.astype(int)).max() <= 1


# -- refusals ------------------------------------------------------------------------------
def test_fp8_matmuls_are_refused_on_cpu_in_one_line():
    config = EngineConfig(model="tiny-flux", quantization="fp8")
    with pytest.raises(EngineConfigError, match="fp8 needs float8 matmuls, which cpu") as info:
        config.executor_config(platform=CpuPlatform())
    assert info.value.field == "quantization" and "\n" not in str(info.value)


def test_a_budget_the_weights_pass_is_refused_naming_what_fits():
    """tiny-flux's weights: about 4.71 MiB as loaded (the VAE 3.9); int8 on
    the transformer brings them to about 4.35 MiB."""
    config = EngineConfig(model="tiny-flux", device_memory_budget=4_600_000)
    with pytest.raises(EngineConfigError, match="over the budget") as info:
        config.executor_config(platform=CpuPlatform())
    message = str(info.value)
    assert info.value.field == "device_memory_budget"
    assert "it fits with quantization='int8'" in message and "offload" not in message  # CPU
    EngineConfig(model="tiny-flux", device_memory_budget=4_600_000,
                 quantization="int8").executor_config(platform=CpuPlatform())
    with pytest.raises(EngineConfigError, match="no weight setting fits it"):
        EngineConfig(model="tiny-flux", device_memory_budget=1 << 20).executor_config(
            platform=CpuPlatform())


def test_the_loaded_weights_are_checked_against_the_budget_too():
    """After loading, the bytes the workers report are what counts: an
    executor built without the budget, then an engine that has it."""
    from diffrt.runtime.factory import make_executor

    plain = EngineConfig(model="tiny-flux", executor_backend="inproc")
    executor = make_executor("inproc", plain.executor_config(platform=CpuPlatform()))
    with pytest.raises(EngineConfigError, match="the loaded weights hold .* it fits with"):
        DiffusionEngine.make_engine(plain.replace(device_memory_budget=4_600_000),
                                    executor=executor)


def test_a_folder_saved_quantised_with_torchao_loads_as_saved(tmp_path):
    """tiny-flux's transformer quantised by diffusers' ``TorchAoConfig``
    (int8 weight-only) and saved: the folder loads as saved, runs as
    ``quantization="int8"`` on the float folder does (the same torchao
    config), is counted and estimated as int8, and is not converted again."""
    import shutil

    from diffusers import FluxTransformer2DModel, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    from diffrt.engine.weights.prequantized import folder_methods

    source = embedded_folder("tiny-flux")
    folder = tmp_path / "tiny-flux-int8"
    shutil.copytree(source, folder)
    shutil.rmtree(folder / "transformer")
    model = FluxTransformer2DModel.from_pretrained(
        source, subfolder="transformer", torch_dtype=torch.float32,
        quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    model.save_pretrained(folder / "transformer", safe_serialization=False)
    assert folder_methods(str(folder)) == {"transformer": "int8"}

    images, held = {}, {}
    for name, kw in (("saved", dict(model=str(folder))), ("converted", dict(quantization="int8"))):
        with engine(**kw) as e:
            # sizes given: a folder by path has the family's defaults, not tiny-flux's
            images[name] = pixels(e.generate(flux_request(3, height=64, width=64)))
            held[name] = e.weight_bytes.components["transformer"]["cpu"]
            assert e.weight_bytes.methods["transformer"] == "int8"
    assert np.array_equal(images["saved"], images["converted"])
    assert held["saved"] == held["converted"]
    estimate = components(str(folder))["transformer"].bytes("none", 4)
    assert estimate == components(source)["transformer"].bytes("int8", 4)
    with pytest.raises(EngineConfigError, match="saved quantised .* leave quantization='none'"):
        EngineConfig(model=str(folder), quantization="int8").model_spec()


def test_a_component_shipped_as_gguf_loads_and_draws_near_the_float_image(tmp_path):
    """tiny-flux with its transformer's weights as a Q8_0 GGUF file (written
    here with gguf's writer) in place of its safetensors: loaded by diffusers'
    GGUF support, reported and estimated as gguf to the byte, within the int8
    PSNR of the float image, in step mode too; converting it is refused."""
    from diffusers import FluxTransformer2DModel

    from diffrt.engine.models.gguf_file import gguf_folder

    source = embedded_folder("tiny-flux")
    folder = gguf_folder(source, str(tmp_path / "tiny-flux-gguf"))
    float_model = FluxTransformer2DModel.from_pretrained(source, subfolder="transformer")

    request = flux_request(3, height=64, width=64)
    with engine() as e:
        want = pixels(e.generate(request))
    for step in (False, True):
        with engine(model=str(folder), step_execution=step) as e:
            got = pixels(e.generate(request))
            assert e.weight_bytes.methods["transformer"] == "gguf"
            held = e.weight_bytes.components["transformer"]["cpu"]
        assert psnr(got, want) >= MIN_PSNR["int8"], psnr(got, want)
    floats = resident_bytes(float_model)["cpu"]
    assert held <= 0.4 * floats  # Q8_0: 34 bytes per 32 values, the norms and biases float
    assert components(str(folder))["transformer"].bytes("none", 4) == held
    with pytest.raises(EngineConfigError, match="saved quantised \\(gguf\\)"):
        EngineConfig(model=str(folder), quantization="int8").model_spec()
