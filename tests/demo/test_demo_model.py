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
from diffrt.engine.pipelines.registry import resolve_model_spec
from diffrt.engine.pipelines.shipped import shipped_folder

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
