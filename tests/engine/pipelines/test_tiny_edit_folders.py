"""The tiny image-editing folders: FLUX.1 Kontext and Qwen-Image-Edit.

diffusers' own pipelines load each folder offline and edit a 64x64 image into
an output of the requested size (Kontext, Kontext inpaint; Qwen-Image-Edit,
its Plus variant with two input images, its inpaint variant), the input image
shows in the output, and two builds with one seed write the same bytes.

Kontext takes explicit small sizes (``max_area`` = the output's area,
``_auto_resize=False``). The Qwen-Image-Edit pipelines always encode the
input at about 1024x1024 pixels (7 s in the tiny VAE on this CPU), so one
test runs ``QwenImageEditPipeline`` as diffusers ships it and the others
shrink that area to 64x64 (``small_edit_area``: diffusers' module-level
``calculate_dimensions`` / ``VAE_IMAGE_SIZE``). Without torchvision the
folder's ``Qwen2VLProcessor`` cannot be built by transformers 5, so the
pipelines get ``load_vl_processor``'s image-only one.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from diffrt.engine.models.tiny.flux import build_tiny_flux_kontext_folder
from diffrt.engine.models.tiny.qwen_image import QWEN_TEMPLATE, TEMPLATE_DROP
from diffrt.engine.models.tiny.qwen_image_edit import (
    EDIT_TEMPLATE,
    EDIT_TEMPLATE_DROP,
    build_tiny_qwen_image_edit_folder,
)
from diffrt.engine.models.vl_processor import load_vl_processor

SIZE, STEPS = 64, 2
PROMPT = "make the sky red"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(kind: str) -> Image.Image:
    if kind == "noise":
        return Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3),
                                                                 dtype=np.uint8))
    if kind == "gradient":
        ramp = np.linspace(0, 255, SIZE)
        return Image.fromarray(np.stack([ramp[None, :].repeat(SIZE, 0), ramp[:, None].repeat(SIZE, 1),
                                         np.full((SIZE, SIZE), 128.0)], -1).astype(np.uint8))
    return Image.fromarray(np.full((SIZE, SIZE, 3), 200, np.uint8))


#: white (repainted) on the right half
MASK = Image.fromarray(np.where(np.arange(SIZE)[None, :].repeat(SIZE, 0) >= SIZE // 2, 255, 0)
                       .astype(np.uint8))


def _diff_255(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean() * 255)


def _generate(pipe, **kwargs) -> np.ndarray:
    kwargs.setdefault("prompt", PROMPT)
    out = pipe(num_inference_steps=STEPS, output_type="np",
               generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.images[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("edit_folders")
    return {"kontext": build_tiny_flux_kontext_folder(root / "kontext"),
            "qwen": build_tiny_qwen_image_edit_folder(root / "qwen")}


# ---------------------------------------------------------------------------
# FLUX.1 Kontext
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kontext(folders):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(folders["kontext"], local_files_only=True,
                                               dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _kontext(pipe, image, height=SIZE, width=SIZE, **kwargs) -> np.ndarray:
    # the output takes max_area at the asked aspect ratio; the input keeps its size
    return _generate(pipe, image=image, height=height, width=width, max_area=height * width,
                     _auto_resize=False, **kwargs)


def test_kontext_folder_layout(folders):
    index = json.loads((folders["kontext"] / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"
    assert index["image_encoder"] == index["feature_extractor"] == [None, None]
    config = json.loads((folders["kontext"] / "transformer" / "config.json").read_text())
    assert config["guidance_embeds"]  # FLUX.1 Kontext [dev] is guidance-distilled


def test_kontext_edits_at_the_requested_size(kontext):
    first = _kontext(kontext, _image("noise"))
    assert first.shape == (SIZE, SIZE, 3) and np.isfinite(first).all() and first.std() > 0.05
    np.testing.assert_array_equal(first, _kontext(kontext, _image("noise")))
    # the output's size is the request's, not the input image's
    assert _kontext(kontext, _image("noise"), height=48, width=80).shape == (48, 80, 3)


def test_kontext_input_image_and_prompt_show(kontext):
    base = _kontext(kontext, _image("noise"))
    for other in ("gradient", "flat"):
        assert _diff_255(base, _kontext(kontext, _image(other))) > 5, other
    assert _diff_255(base, _kontext(kontext, _image("noise"), prompt="a blue car")) > 10


def test_kontext_inpaint_keeps_the_unmasked_latents(folders):
    from diffusers import FluxKontextInpaintPipeline

    pipe = FluxKontextInpaintPipeline.from_pretrained(folders["kontext"], local_files_only=True,
                                                      dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    image = _image("noise")
    kwargs = dict(image=image, mask_image=MASK, height=SIZE, width=SIZE, max_area=SIZE * SIZE,
                  _auto_resize=False, strength=1.0)
    assert _generate(pipe, **kwargs).shape == (SIZE, SIZE, 3)  # the input image's size
    latents = pipe(prompt=PROMPT, num_inference_steps=STEPS, output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(0), **kwargs).images
    with torch.no_grad():
        encoded = pipe._encode_vae_image(pipe.image_processor.preprocess(image, SIZE, SIZE),
                                         generator=None)
    grid = SIZE // pipe.vae_scale_factor // 2  # packed tokens per side
    packed = pipe._pack_latents(encoded, 1, encoded.shape[1], 2 * grid, 2 * grid)
    kept = (torch.arange(grid * grid) % grid) < grid // 2  # token columns left of the mask
    torch.testing.assert_close(latents[:, kept], packed[:, kept], rtol=0, atol=0)
    assert (latents[:, ~kept] - packed[:, ~kept]).abs().mean() > 0.1


# ---------------------------------------------------------------------------
# Qwen-Image-Edit
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(folders):
    return load_vl_processor(folders["qwen"] / "processor")


def _qwen_pipe(cls_name: str, folder, processor):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, processor=processor,
                                                        local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def qwen_edit(folders, processor):
    return _qwen_pipe("QwenImageEditPipeline", folders["qwen"], processor)


@pytest.fixture
def small_edit_area(monkeypatch):
    """The Qwen-Image-Edit pipelines' fixed input areas (1024x1024 for the
    VAE, 384x384 for the VL encoder) shrunk to 64x64."""
    from diffusers.pipelines.qwenimage import (
        pipeline_qwenimage_edit,
        pipeline_qwenimage_edit_inpaint,
        pipeline_qwenimage_edit_plus,
    )

    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_inpaint):
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions",
                            lambda area, ratio, original=original: original(SIZE * SIZE, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SIZE * SIZE)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", SIZE * SIZE)


def test_qwen_edit_as_diffusers_ships_it(qwen_edit):
    """Input encoded at 1024x1024, the output at the requested 64x64."""
    out = _generate(qwen_edit, image=_image("noise"), height=SIZE, width=SIZE)
    assert out.shape == (SIZE, SIZE, 3) and np.isfinite(out).all() and out.std() > 0.05


def test_qwen_edit_repeats_and_the_input_and_prompt_show(qwen_edit, small_edit_area):
    base = _generate(qwen_edit, image=_image("noise"), height=SIZE, width=SIZE)
    np.testing.assert_array_equal(base, _generate(qwen_edit, image=_image("noise"), height=SIZE,
                                                  width=SIZE))
    assert _generate(qwen_edit, image=_image("noise"), height=48, width=80).shape == (48, 80, 3)
    for other in ("gradient", "flat"):  # through the VL encoder (see models/tiny/qwen_image_edit.py)
        assert _diff_255(base, _generate(qwen_edit, image=_image(other), height=SIZE,
                                         width=SIZE)) > 3, other
    assert _diff_255(base, _generate(qwen_edit, image=_image("noise"), prompt="a blue car",
                                     height=SIZE, width=SIZE)) > 3


def test_qwen_edit_plus_takes_two_images_from_the_same_folder(folders, processor,
                                                              small_edit_area):
    pipe = _qwen_pipe("QwenImageEditPlusPipeline", folders["qwen"], processor)
    images = [_image("noise"), _image("gradient")]
    out = _generate(pipe, image=images, height=SIZE, width=SIZE)
    assert out.shape == (SIZE, SIZE, 3) and np.isfinite(out).all()
    assert _diff_255(out, _generate(pipe, image=images[::-1], height=SIZE, width=SIZE)) > 1


def test_qwen_edit_inpaint(folders, processor, small_edit_area):
    pipe = _qwen_pipe("QwenImageEditInpaintPipeline", folders["qwen"], processor)
    # the inpaint pipeline's output takes the input's (shrunk) area, not height/width
    out = _generate(pipe, image=_image("noise"), mask_image=MASK, strength=1.0)
    assert out.shape == (SIZE, SIZE, 3) and np.isfinite(out).all()


def test_qwen_edit_plus_and_2511_variants(tmp_path, processor, small_edit_area):
    folder = build_tiny_qwen_image_edit_folder(tmp_path / "plus", plus=True, zero_cond_t=True)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    pipe = _qwen_pipe("QwenImageEditPlusPipeline", folder, processor)
    assert pipe.transformer.config.zero_cond_t
    assert _generate(pipe, image=[_image("noise"), _image("flat")], height=SIZE,
                     width=SIZE).shape == (SIZE, SIZE, 3)


def test_qwen_edit_templates_are_the_pipelines(qwen_edit, folders, processor):
    """The folder's constants are diffusers' own, and the tokenizer splits
    both templates' system prefixes into the tokens their pipelines drop."""
    from diffusers import QwenImageEditInpaintPipeline, QwenImageEditPlusPipeline

    assert qwen_edit.prompt_template_encode == EDIT_TEMPLATE
    assert qwen_edit.prompt_template_encode_start_idx == EDIT_TEMPLATE_DROP
    plus = QwenImageEditPlusPipeline(**qwen_edit.components)
    assert plus.prompt_template_encode == EDIT_TEMPLATE.replace(VISION, "")
    inpaint = QwenImageEditInpaintPipeline(**qwen_edit.components)
    assert inpaint.prompt_template_encode == EDIT_TEMPLATE
    assert plus.prompt_template_encode_start_idx == inpaint.prompt_template_encode_start_idx \
        == EDIT_TEMPLATE_DROP
    tokenizer = processor.tokenizer
    for template, drop in ((EDIT_TEMPLATE, EDIT_TEMPLATE_DROP), (QWEN_TEMPLATE, TEMPLATE_DROP)):
        tokens = tokenizer.tokenize(template.format("a red fox"))
        assert tokens[drop - 3:drop] == ["<|im_start|>", "user", "Ċ"], template
    tokens = tokenizer.tokenize(EDIT_TEMPLATE.format("a red fox"))
    assert tokens[EDIT_TEMPLATE_DROP:EDIT_TEMPLATE_DROP + 6] == [
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "a", "Ġred", "Ġfox"]
    assert _files(folders["qwen"] / "tokenizer") == {
        name: data for name, data in _files(folders["qwen"] / "processor").items()
        if name.startswith("tokenizer")}


def test_qwen_edit_processor_gives_few_image_tokens(processor):
    """The pipelines hand the VL encoder ~1024x1024 (Edit) or 384x384 (Plus)
    pixels: 56x56 after the processor, 4 tokens after the 2x2 merge."""
    text = [EDIT_TEMPLATE.format("a red fox")]
    for side in (1024, 384, 64):
        image = _image("noise").resize((side, side))
        inputs = processor(text=text, images=image, padding=True, return_tensors="pt")
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert int((inputs["input_ids"] == pad).sum()) == 4
    chat = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False, add_generation_prompt=True)
    assert chat.endswith(f"<|im_start|>user\n{VISION}hi<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------
# Same seed, same bytes
# ---------------------------------------------------------------------------


def _files(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(folders, tmp_path):
    again = {"kontext": build_tiny_flux_kontext_folder(tmp_path / "kontext"),
             "qwen": build_tiny_qwen_image_edit_folder(tmp_path / "qwen")}
    for kind, folder in again.items():
        before, after = _files(folders[kind]), _files(folder)
        assert before == after, kind
        assert sum(name.endswith(".safetensors") for name in before) == (4 if kind == "kontext"
                                                                         else 3)
    other = build_tiny_qwen_image_edit_folder(tmp_path / "other", seed=1)
    name = os.path.join("transformer", "diffusion_pytorch_model.safetensors")
    assert _files(other)[name] != _files(folders["qwen"])[name]


def test_the_edit_builders_sources_key_their_folders():
    """Registered, the Qwen-Image-Edit builder's folder key would cover the
    Qwen-Image builder it takes its pieces from."""
    from diffrt.engine.models import embedded

    root = os.path.dirname(embedded.SHARED_SOURCE)
    sources = embedded.module_sources("diffrt.engine.models.tiny.qwen_image_edit")
    assert [os.path.relpath(p, root) for p in sources] == [
        "qwen_image_edit.py", "qwen_image.py", "shared.py"]
    assert [os.path.relpath(p, root) for p in embedded.module_sources(
        "diffrt.engine.models.tiny.flux")] == [
        "flux.py", "shared.py"]
