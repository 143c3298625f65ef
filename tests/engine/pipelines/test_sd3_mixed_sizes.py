"""Requests of different sizes share a denoise step on SD3 (``sd3/mixed.py``):
each request of a mixed batch equals its own run alone within 1/255
(float32), with and without CFG, with different step counts and output
counts and a latent output among them; the stats show the steps were
shared. SD3.5's dual-attention blocks take mixed rows too, and the mixed
forward over one size is diffusers' forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_clean, assert_shared_steps, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder
from diffrt.engine.pipelines import StepRequestState, load_pipeline
from diffrt.engine.pipelines.sd3.mixed import forward_rows
from diffrt.engine.pipelines.segments import RowLayout

#: (height, width, outputs, steps, output type): the four sizes of Flux's
#: test (all within tiny-sd3's 512-pixel position grid), one of them latents
SHAPES = [(64, 64, 1, 3, "pil"), (128, 128, 1, 4, "pil"), (64, 128, 2, 2, "pil"),
          (96, 64, 1, 3, "latent")]


def request(i: int, height: int, width: int, n: int, steps: int, output_type: str, *,
            cfg: bool) -> DiffusionRequest:
    # SD3 runs CFG when guidance_scale > 1 (its default is 7)
    return DiffusionRequest(
        prompt=f"a red fox {i}", negative_prompt="blurry" if cfg else None,
        sampling_params=SamplingParams(height=height, width=width, num_outputs_per_prompt=n,
                                       num_inference_steps=steps, seed=i,
                                       guidance_scale=3.0 if cfg else 1.0,
                                       output_type=output_type))


def outputs(out) -> list[np.ndarray]:
    assert out.ok, out.error
    if out.images is None:  # latents
        return [out.output.numpy()]
    return [np.asarray(image).astype(np.int16) for image in out.images]


@pytest.fixture(scope="module")
def engine():
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model="tiny-sd3", executor_backend="inproc", step_execution=True,
            max_num_seqs=8, warmup=False, mixed_rows="padded", share_steps="always"))) as engine:
        yield engine


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
def test_each_request_of_a_mixed_batch_equals_its_run_alone(engine, cfg):
    reqs = [request(i, *shape, cfg=cfg) for i, shape in enumerate(SHAPES)]
    alone = [engine.generate(r) for r in reqs]
    before = engine.stats().step_batch_rows
    together = engine.generate(reqs)
    after = engine.stats().step_batch_rows
    for got, want, (_, _, _, _, output_type) in zip(together, alone, SHAPES, strict=True):
        # latents: float32 noise of reassociated sums; pixels: 1/255
        tolerance = 1e-4 if output_type == "latent" else 1
        for a, b in zip(outputs(got), outputs(want), strict=True):
            assert a.shape == b.shape
            assert np.abs(a - b).max() <= tolerance
    assert [o.images[0].size for o in together[:3]] == [(w, h) for h, w, *_ in SHAPES[:3]]
    assert together[3].images is None and together[3].output.shape == (1, 4, 12, 8)
    # they shared steps: the first steps ran all 5 rows (10 with CFG) at once
    assert_shared_steps(before, after, 5 * (2 if cfg else 1), max(shape[3] for shape in SHAPES))
    assert_clean(engine)


def test_sd35_dual_attention_takes_rows_of_several_sizes(tmp_path):
    """One mixed step on an SD3.5 folder (a dual-attention block, RMS q/k
    norm): each request's prediction is its prediction alone."""
    pipe = load_pipeline(str(build_tiny_sd3_folder(tmp_path / "sd35", sd35=True)))
    assert pipe.transformer.transformer_blocks[0].attn2 is not None
    reqs = [request(i, h, w, n, 2, "pil", cfg=True) for i, (h, w, n) in
            enumerate([(64, 64, 1), (96, 128, 2), (128, 64, 1)])]
    states = [StepRequestState(r) for r in reqs]
    for state in states:
        pipe.prepare_encode(state)
    mixed = pipe.split_predictions(pipe.denoise_step(states), states)
    for state, got in zip(states, mixed, strict=True):
        alone = StepRequestState(state.request)
        pipe.prepare_encode(alone)
        want = pipe.denoise_step([alone])
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4)


def test_the_mixed_forward_over_one_size_is_diffusers_forward():
    """``forward_rows`` is diffusers' forward, module for module: over rows of
    one size (no padding) it gives diffusers' prediction."""
    pipe = load_pipeline("tiny-sd3")
    generator = torch.Generator().manual_seed(0)
    size, rows = (8, 12), 2
    latents = torch.randn(rows, 4, *size, generator=generator)
    embeds = torch.randn(rows, 7, pipe.transformer.config.joint_attention_dim, generator=generator)
    pooled = torch.randn(rows, pipe.transformer.config.pooled_projection_dim, generator=generator)
    timesteps = torch.tensor([1000.0, 500.0])
    layout = RowLayout.uniform_rows(size, pipe.latents.tokens(size), rows)
    with torch.no_grad():
        ours = forward_rows(pipe.transformer, hidden_states=pipe.pack_latents(latents),
                            encoder_hidden_states=embeds, pooled_projections=pooled,
                            timestep=timesteps, layout=layout)
        theirs = pipe.transformer(hidden_states=latents, encoder_hidden_states=embeds,
                                  pooled_projections=pooled, timestep=timesteps,
                                  return_dict=False)[0]
    assert torch.allclose(ours, pipe.pack_latents(theirs), atol=1e-5)
