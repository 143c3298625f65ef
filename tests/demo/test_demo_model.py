"""diffrt-shapes, the shipped default model, draws what its prompts say,
through the engine in request and step mode with several requests batched:
the classifier reads most prompts' attributes back (``shape_checks``), and the
pixels are those of diffusers' FluxPipeline loaded from the same folder
(≤ 2/255), so the content check and the pixel check cover each other.
Worker processes (the CLI's demo command) and HTTP (the shared real server)
ask the same model in tests/cli and tests/serve."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from shape_checks import SCENES, assert_drawn

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.models.shipped import shipped_folder

FOLDER = shipped_folder("diffrt-shapes")


def requests(tag: str) -> list[DiffusionRequest]:
    # no sizes, steps or guidance: the model's own (64x64, 12 steps, true CFG 3 against "")
    return [DiffusionRequest(s.prompt, request_id=f"{tag}-{i}",
                             sampling_params=SamplingParams(seed=i))
            for i, s in enumerate(SCENES)]


@pytest.fixture(scope="module")
def diffusers_pixels() -> list[np.ndarray]:
    """diffusers' own FluxPipeline on the folder, as its model card says to load it."""
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(FOLDER, local_files_only=True,
                                                  torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return [np.asarray(pipe(s.prompt, negative_prompt="", true_cfg_scale=3.0, height=64,
                            width=64, num_inference_steps=12, guidance_scale=1.0,
                            max_sequence_length=16,
                            generator=torch.Generator().manual_seed(i)).images[0],
                       dtype=np.int16) for i, s in enumerate(SCENES)]


def test_the_shipped_folder_carries_its_defaults_and_its_model_card():
    cls = resolve_model_spec("diffrt-shapes")
    by_path = resolve_model_spec(FOLDER)  # the folder by path keeps its defaults
    assert by_path.defaults == cls.defaults
    assert by_path.default_negative_prompt == cls.default_negative_prompt == ""
    assert cls.max_size == 512  # Flux's 2048 is for an 8x VAE: the same token bound
    d = cls.defaults
    assert (d.height, d.width, d.num_inference_steps, d.true_cfg_scale) == (64, 64, 12, 3.0)
    # guided by default, against the empty prompt; not when asked for no CFG
    assert cls.uses_cfg(cls.with_defaults(requests("defaults")[0]))
    assert not cls.uses_cfg(cls.with_defaults(DiffusionRequest(
        "a red circle", sampling_params=SamplingParams(true_cfg_scale=1.0))))
    # the trained text length travels with the folder: diffusers is not left to pad to 512
    with open(f"{FOLDER}/tokenizer_2/tokenizer_config.json", encoding="utf-8") as f:
        assert json.load(f)["model_max_length"] == 16
    card = open(f"{FOLDER}/README.md", encoding="utf-8").read()
    assert "max_sequence_length=16" in card and "| colour | shape | position | background |" in card
    with open(f"{FOLDER}/evaluation.json", encoding="utf-8") as f:
        table = json.load(f)
    assert table["prompts"] >= 20
    default = next(row for row in table["rows"] if row["true_cfg_scale"] == 3.0)
    # the goals on held-out prompts, at the model's defaults
    assert default["colour"] >= 0.9 and default["shape"] >= 0.8
    assert default["position"] >= 0.9 and default["background"] >= 0.9


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_the_engine_draws_the_prompts_as_diffusers_does(step, diffusers_pixels):
    with DiffusionEngine.make_engine(EngineConfig(  # float32, as diffusers' pixels here
            executor_backend="inproc", dtype="float32", step_execution=step,
            max_num_seqs=4)) as engine:
        outs = engine.generate(requests("request" if not step else "step"), timeout=300)
    assert all(o.ok for o in outs), [o.error for o in outs]
    images = [o.images[0] for o in outs]
    assert all(im.size == (64, 64) for im in images)
    assert_drawn(SCENES, images)
    for scene, image, want in zip(SCENES, images, diffusers_pixels, strict=True):
        diff = np.abs(np.asarray(image, dtype=np.int16) - want).max()
        assert diff <= 2, f"{scene.prompt!r}: {diff}/255 from diffusers"


def test_edits_take_the_layout_from_the_image_or_the_prompt_as_strength_says():
    """A red circle in the top left, prompted for a blue circle in the bottom
    right: at strength 0.3 the circle stays where the image has it, at 1.0 it
    goes where the prompt says. Inpainting the bottom-right cell of a plain
    picture draws the prompt's square there and keeps every pixel outside the
    mask. All in one step batch, with the classifier reading each picture."""
    from PIL import Image

    from diffrt.demo.shapes import Scene, classify, render

    red_top_left = render(Scene("circle", "red", "yellow", "top left"))
    plain = Image.new("RGB", (64, 64), (128, 128, 128))
    mask = np.zeros((64, 64), np.uint8)
    mask[43:, 43:] = 255  # the bottom-right cell
    moved = "a blue circle on a yellow background in the bottom right"
    edits = [DiffusionRequest(moved, request_id=f"i2i-{strength}-{seed}", images=[red_top_left],
                              sampling_params=SamplingParams(seed=seed, strength=strength))
             for strength in (0.3, 1.0) for seed in (0, 1)][1:]
    edits += [DiffusionRequest("a green square on a gray background in the bottom right",
                               request_id=f"inpaint-{seed}", images=[plain],
                               mask_image=Image.fromarray(mask),
                               sampling_params=SamplingParams(seed=seed, strength=1.0))
              for seed in (0,)]
    with DiffusionEngine.make_engine(EngineConfig(executor_backend="inproc", dtype="float32",
                                                  step_execution=True, max_num_seqs=8)) as engine:
        outs = engine.generate(edits, timeout=300)
    assert all(o.ok for o in outs), [o.error for o in outs]
    readings = {o.request_id: classify(o.images[0]) for o in outs}
    assert readings["i2i-0.3-1"].position == "top left", readings
    assert readings["i2i-1.0-0"].position == readings["i2i-1.0-1"].position == "bottom right"
    inpainted = readings["inpaint-0"]
    assert (inpainted.colour, inpainted.shape, inpainted.position) == (
        "green", "square", "bottom right"), readings
    for out in outs[3:]:
        diff = np.abs(np.asarray(out.images[0], dtype=np.int16) - np.asarray(plain, np.int16))
        assert diff.max(-1)[mask == 0].max() <= 2
