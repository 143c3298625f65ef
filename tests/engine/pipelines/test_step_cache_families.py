"""Each family's transformer call cut at its blocks (``*/blocks.py``) for the
step caches: with a threshold of 0 (nothing reused) a cached request gives
the uncached request's bits, in request mode, with CFG, for Flux, SD3 and
Qwen-Image (whose diffusers forward the uncached path is); a cached request
reuses steps; and rows of several sizes padded into one call decide as
alone (SD3, Qwen-Image: their own padded forwards)."""

from __future__ import annotations

import pytest
import torch

from diffrt.engine.pipelines import load_pipeline
from diffrt.engine.pipelines.interface import DiffusionRequestBatch, StepRequestState
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def families(pipelines, qwen_folder) -> dict:
    return {**pipelines, "qwen-image": load_pipeline(qwen_folder)}


@pytest.fixture(params=["tiny-flux", "tiny-sd3", "qwen-image"])
def pipe(request, families):
    return families[request.param]


def request(rid: str, *, size: int = 32, steps: int = 4, cache: str | None = None,
            threshold: float | None = None, seed: int = 3, prompt: str = "a red fox"
            ) -> DiffusionRequest:
    # CFG on: SD3's guidance_scale, Flux's and Qwen-Image's true CFG with a negative prompt
    return DiffusionRequest(prompt=prompt, request_id=rid, negative_prompt="blurry",
                            sampling_params=SamplingParams(
                                height=size, width=size, num_inference_steps=steps, seed=seed,
                                guidance_scale=3.0, true_cfg_scale=3.0, cache=cache,
                                cache_threshold=threshold))


def run(pipe, r: DiffusionRequest):
    out = pipe.forward(DiffusionRequestBatch([r]))[0]
    return out, pipe.take_cache_metrics().get(r.request_id)


def test_nothing_reused_gives_the_uncached_bits(pipe):
    assert pipe.spec.uses_cfg(pipe.prepared(request("p")))
    plain, _ = run(pipe, request("plain"))
    for policy in ("first-block", "teacache"):
        cached, metrics = run(pipe, request("zero", cache=policy, threshold=0.0))
        assert metrics.steps_computed == 4 and metrics.steps_reused == 0
        assert torch.equal(cached, plain)
        reused, metrics = run(pipe, request("high", cache=policy, threshold=2.0))
        assert 0 < metrics.steps_reused < 4 and metrics.reused_steps[0] >= 1
        assert not torch.equal(reused, plain)


def steps_together(pipe, requests: list[DiffusionRequest]) -> list[torch.Tensor]:
    """The step protocol over ``requests`` of different step counts at once
    (each advances until its own last step), as the engine's worker runs it."""
    states = [StepRequestState(request=r) for r in requests]
    pipe.prepare_encode_batch(states)
    while running := [s for s in states if not s.finished]:
        for state, part in zip(running, pipe.split_predictions(pipe.denoise_step(running),
                                                               running), strict=True):
            pipe.apply_step(state, part)
    return pipe.post_decode_batch(states)


@pytest.mark.parametrize("name", ["tiny-sd3", "qwen-image"])
def test_rows_of_several_sizes_padded_into_one_call_decide_as_alone(families, name):
    pipe = families[name]
    kept = pipe.mixed_rows
    pipe.mixed_rows = "padded"
    try:
        mix = [request("a", steps=4, cache="first-block", threshold=1.0),
               request("b", size=48, steps=5, cache="teacache", threshold=1.5, seed=4,
                       prompt="an old castle on a hill at sunset"),
               request("c", steps=3, seed=5)]
        alone = [steps_together(pipe, [r])[0] for r in mix]
        solo_metrics = pipe.take_cache_metrics()
        together = steps_together(pipe, mix)
        metrics = pipe.take_cache_metrics()
    finally:
        pipe.mixed_rows = kept
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 2 / 255  # images in [-1, 1]: 1/255 in [0, 1]
    for rid in ("a", "b"):
        assert metrics[rid].reused_steps == solo_metrics[rid].reused_steps
        assert metrics[rid].steps_reused > 0
    assert "c" not in metrics
