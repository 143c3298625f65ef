"""Qwen-Image on a complete tiny folder gives diffusers' own
``QwenImagePipeline`` pixels for the same folder, prompts and seeds: with and
without true CFG (whose result diffusers rescales to the conditional norm),
whole requests and step by step, alone and batched (prompts of different
token counts padded and masked in one batch). The tiny folder's tokenizer
splits the template's system prefix into the 34 tokens the pipeline drops,
and its transformer reacts to the prompt."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.tiny.qwen_image import (
    QWEN_TEMPLATE,
    TEMPLATE_DROP,
)

SIZE, STEPS = 64, 3
MAX_DIFF = 2  # of 255, fp32
#: (prompt, negative prompt, true_cfg_scale, seed): token counts differ
CASES = [("a red fox in the snow", None, 1.0, 0),
         ("an old castle on a hill at sunset", "blurry", 4.0, 1),
         ("a cat", "low quality, dark", 3.0, 2),
         ("a blue car", "blurry", None, 3)]  # None: the model's default 4.0, as diffusers


@pytest.fixture(scope="module")
def folder(qwen_folder):
    return qwen_folder


@pytest.fixture(scope="module")
def diffusers_images(folder):
    import diffusers

    pipe = diffusers.QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)

    def run(prompt, negative, scale, seed):
        kwargs = {} if scale is None else {"true_cfg_scale": scale}
        image = pipe(prompt, negative_prompt=negative, height=SIZE, width=SIZE,
                     num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                     output_type="np", **kwargs).images[0]
        return (image * 255).round().astype(np.int16)

    return [run(*case) for case in CASES]


def requests() -> list[DiffusionRequest]:
    return [DiffusionRequest(prompt, negative_prompt=negative, sampling_params=SamplingParams(
        height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=seed, true_cfg_scale=scale))
        for prompt, negative, scale, seed in CASES]


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_qwen_image_matches_diffusers_alone_and_batched(step, folder, diffusers_images):
    for batch in (1, 4):
        with DiffusionEngine.make_engine(EngineConfig(
                model=folder, executor_backend="inproc", step_execution=step,
                max_num_seqs=batch)) as engine:
            outs = engine.generate(requests(), timeout=120)
        for out, want in zip(outs, diffusers_images, strict=True):
            assert out.ok, out.error
            got = np.asarray(out.images[0]).astype(np.int16)
            assert np.abs(got - want).max() <= MAX_DIFF, (step, batch, out.request_id)


def test_the_template_prefix_is_the_tokens_the_pipeline_drops(folder):
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(f"{folder}/tokenizer")
    prefix = QWEN_TEMPLATE.split("{}")[0]
    assert len(tokenizer(prefix, add_special_tokens=False).input_ids) == TEMPLATE_DROP
    tokens = tokenizer.tokenize(QWEN_TEMPLATE.format("a red fox"))
    assert tokens[TEMPLATE_DROP:TEMPLATE_DROP + 3] == ["a", "Ġred", "Ġfox"]


def test_different_prompts_give_clearly_different_images(diffusers_images, folder):
    with DiffusionEngine.make_engine(EngineConfig(model=folder, executor_backend="inproc",
                                                  max_num_seqs=4)) as engine:
        outs = engine.generate([DiffusionRequest(p, sampling_params=SamplingParams(
            height=SIZE, width=SIZE, num_inference_steps=4, seed=0))
            for p in ("a red fox in the snow", "an old castle on a hill", "a blue car",
                      "a cat sitting on a chair")], timeout=120)
    images = [np.asarray(o.images[0]).astype(np.float64) for o in outs]
    differences = [np.abs(a - b).mean() for a, b in itertools.combinations(images, 2)]
    assert min(differences) > 3.0, differences  # mean /255; 0.1-0.2 without the boost


def test_step_mode_streams_previews(folder):
    """Previews in step mode (what the server streams as partial images)."""
    import asyncio

    with DiffusionEngine.make_engine(EngineConfig(model=folder, executor_backend="inproc",
                                                  step_execution=True)) as engine:
        async def collect():
            request = DiffusionRequest("a red fox", sampling_params=SamplingParams(
                height=SIZE, width=SIZE, num_inference_steps=4, seed=0, partial_images=1))
            return [o async for o in engine.step_streaming(request)]

        outs = asyncio.run(collect())
    previews = [o for o in outs if o.preview is not None]
    assert len(previews) == 1 and previews[0].preview[0].size == (SIZE, SIZE)
    assert outs[-1].ok and outs[-1].images[0].size == (SIZE, SIZE)
