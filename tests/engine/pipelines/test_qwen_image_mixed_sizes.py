"""Qwen-Image requests of different sizes share a denoise step
(``mixed_size_batching``, ``qwen_image/mixed.py``): each request of a mixed
batch equals its own run alone within 1/255 (float32), with and without true
CFG, with prompts of different token counts and different step counts; the
stats show the steps were shared. The row forward itself gives diffusers'
forward on a batch of one size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_clean, assert_shared_steps, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

#: (height, width, outputs, steps): sizes 16 px apart (the tiny folder's
#: multiple), one of them with two outputs
SHAPES = [(64, 64, 1, 3), (128, 128, 1, 4), (64, 128, 2, 2), (96, 64, 1, 3)]
#: token counts differ, so rows' text is padded and masked too
PROMPTS = ["a red fox", "an old castle on a hill at sunset", "a cat",
           "a blue car parked by the sea"]
NEGATIVES = ["blurry", "low quality, dark", "blurry", "a dull grey picture"]


@pytest.fixture(scope="module")
def folder(qwen_folder):
    return qwen_folder


@pytest.fixture(scope="module")
def mixed(folder):
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model=folder, executor_backend="inproc", step_execution=True, max_num_seqs=8,
            warmup=False, mixed_rows="padded", share_steps="always"))) as engine:
        yield engine


def batch(cfg: bool) -> list[DiffusionRequest]:
    # true_cfg_scale 1.0 turns Qwen-Image's true CFG off (its default is 4.0)
    return [DiffusionRequest(
        prompt, negative_prompt=negative if cfg else None, sampling_params=SamplingParams(
            height=h, width=w, num_outputs_per_prompt=n, num_inference_steps=steps, seed=i,
            true_cfg_scale=3.0 if cfg else 1.0))
        for i, (prompt, negative, (h, w, n, steps)) in enumerate(zip(PROMPTS, NEGATIVES, SHAPES,
                                                                     strict=True))]


def pixels(out) -> list[np.ndarray]:
    assert out.ok, out.error
    return [np.asarray(image).astype(np.int16) for image in out.images]


def test_the_tiny_folder_takes_the_sizes(mixed):
    spec = mixed.spec
    assert spec.mixed_sizes
    assert all(h % spec.size_multiple == 0 and w % spec.size_multiple == 0
               for h, w, *_ in SHAPES)


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
def test_each_request_of_a_mixed_batch_equals_its_run_alone(mixed, cfg):
    alone = [mixed.generate(r) for r in batch(cfg)]
    before = mixed.stats().step_batch_rows
    together = mixed.generate(batch(cfg))
    after = mixed.stats().step_batch_rows
    worst = 0
    for got, want in zip(together, alone, strict=True):
        for a, b in zip(pixels(got), pixels(want), strict=True):
            assert a.shape == b.shape
            worst = max(worst, int(np.abs(a - b).max()))
    assert worst <= 1, worst
    assert [o.images[0].size for o in together] == [(w, h) for h, w, _, _ in SHAPES]
    # they shared steps: the first steps ran all 5 rows (10 with CFG) at once
    assert_shared_steps(before, after, 5 * (2 if cfg else 1), max(s for *_, s in SHAPES))
    assert_clean(mixed)


def test_the_row_forward_is_diffusers_forward_on_one_size(folder):
    """``forward_rows`` with every row's frequencies (the same size) and the
    text mask gives what diffusers' forward gives for that batch."""
    from diffusers import QwenImageTransformer2DModel

    from diffrt.engine.pipelines.qwen_image.mixed import forward_rows, row_rotary

    model = QwenImageTransformer2DModel.from_pretrained(f"{folder}/transformer").eval()
    generator = torch.Generator().manual_seed(0)
    rows, text, shape = 3, 7, (1, 4, 6)
    latents = torch.randn(rows, 24, model.config.in_channels, generator=generator)
    embeds = torch.randn(rows, text, model.config.joint_attention_dim, generator=generator)
    mask = torch.arange(text)[None, :] < torch.tensor([7, 4, 2])[:, None]
    timestep = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        want = model(hidden_states=latents, encoder_hidden_states=embeds,
                     encoder_hidden_states_mask=mask, timestep=timestep,
                     img_shapes=[[shape]] * rows, return_dict=False)[0]
        got = forward_rows(model, hidden_states=latents, encoder_hidden_states=embeds,
                           timestep=timestep,
                           rotary=row_rotary(model, [[shape]] * rows, text, 24, latents.device),
                           key_mask=torch.cat([mask, torch.ones(rows, 24, dtype=torch.bool)], 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
