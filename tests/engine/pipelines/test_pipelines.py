"""Behaviour of the reference pipelines in both execution styles.

Images are compared after quantisation to uint8: "the same image" means no
pixel differs by more than 1/255 (batched matmuls may reassociate sums).
"""

from __future__ import annotations

import pytest
import torch

from diffrt.engine.pipelines import (
    DiffusionRequestBatch,
    StepRequestState,
    resolve_model_spec,
)
from diffrt.engine.postprocess import output_postprocessor, quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import InvalidRequestError, SamplingParams

SIZE = 64


def make_request(prompt="a red fox", *, negative_prompt=None, **params) -> DiffusionRequest:
    """``guidance_scale`` > 1 asks for classifier-free guidance in both families:
    SD3 runs it from ``guidance_scale``; Flux (as diffusers' FluxPipeline) from
    ``true_cfg_scale`` with a negative prompt, so both are set (the negative
    prompt defaults to "", what SD3 uses when none is given)."""
    params.setdefault("height", SIZE)
    params.setdefault("width", SIZE)
    params.setdefault("num_inference_steps", 2)
    params.setdefault("seed", 0)
    if params.get("guidance_scale", 1.0) > 1.0:
        params.setdefault("true_cfg_scale", params["guidance_scale"])
        negative_prompt = "" if negative_prompt is None else negative_prompt
    return DiffusionRequest(prompt, SamplingParams(**params), negative_prompt=negative_prompt)


def run_request(pipe, *requests) -> list[torch.Tensor]:
    return pipe.forward(DiffusionRequestBatch(list(requests)))


def run_steps(pipe, requests, join_tick=None) -> dict[str, torch.Tensor]:
    """A minimal step-batch loop: request i joins at tick join_tick[i] (default 0);
    all active states share one denoise forward per tick."""
    join_tick = join_tick or [0] * len(requests)
    pending = sorted(zip(join_tick, range(len(requests)), strict=True))
    active: list[StepRequestState] = []
    results: dict[str, torch.Tensor] = {}
    tick = 0
    while pending or active:
        while pending and pending[0][0] <= tick:
            state = StepRequestState(requests[pending.pop(0)[1]])
            pipe.prepare_encode(state)
            active.append(state)
        if active:
            pred = pipe.denoise_step(active)
            for state, part in zip(active, pipe.split_predictions(pred, active), strict=True):
                pipe.apply_step(state, part)
            for state in [s for s in active if s.finished]:
                results[state.request_id] = pipe.post_decode(state)
                active.remove(state)
        tick += 1
    return results


def pixels(images: torch.Tensor) -> torch.Tensor:
    return quantize_images(images).int()


def assert_same_image(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    diff = (pixels(a) - pixels(b)).abs().max().item()
    assert diff <= 1, f"images differ by {diff}/255"


def assert_different_image(a: torch.Tensor, b: torch.Tensor, min_mean: float = 2.0) -> None:
    """Clearly different: the mean pixel difference is far above batching noise
    (which stays under 0.1/255 on average)."""
    mean = (pixels(a) - pixels(b)).abs().float().mean().item()
    assert mean > min_mean, f"images differ by only {mean:.2f}/255 on average"


# -- outputs -------------------------------------------------------------------


def test_forward_returns_images_in_range_per_request(pipe):
    outs = run_request(pipe, make_request(seed=1), make_request(seed=2, prompt="a cat"))
    assert len(outs) == 2
    for out in outs:
        assert out.shape == (1, 3, SIZE, SIZE)
        assert out.dtype == torch.float32
        assert out.min() >= -1 and out.max() <= 1
        assert out.std() > 0.05  # a real image, not a constant


@pytest.mark.parametrize("output_type", ["pil", "pt"])
def test_image_output_types_quantise_and_postprocess(pipe, output_type):
    request = make_request(output_type=output_type, width=2 * SIZE)
    params = request.sampling_params
    out = run_request(pipe, request)[0]
    transferred = pipe.to_transfer(out, params)
    assert transferred.dtype == torch.uint8
    assert transferred.shape == (1, SIZE, 2 * SIZE, 3)
    images, tensor = output_postprocessor(pipe.spec)(transferred, output_type)
    if output_type == "pil":
        assert tensor is None and len(images) == 1
        assert images[0].size == (2 * SIZE, SIZE) and images[0].mode == "RGB"
    else:
        assert images is None and torch.equal(tensor, transferred)


def test_latent_output_skips_decode(pipe, monkeypatch):
    def no_decode(*args, **kwargs):
        raise AssertionError("decode must not run for output_type='latent'")

    monkeypatch.setattr(pipe.vae, "decode", no_decode)
    request = make_request(output_type="latent", num_outputs_per_prompt=2)
    out = run_request(pipe, request)[0]
    f = pipe.vae_scale_factor
    assert out.shape == (2, pipe.latent_channels, SIZE // f, SIZE // f)
    assert pipe.to_transfer(out, request.sampling_params) is out
    step_out = run_steps(pipe, [request])[request.request_id]
    torch.testing.assert_close(step_out, out)


def test_num_outputs_per_prompt(pipe):
    single = run_request(pipe, make_request(seed=5))[0]
    double = run_request(pipe, make_request(seed=5, num_outputs_per_prompt=2))[0]
    assert double.shape == (2, 3, SIZE, SIZE)
    # the request's generator draws both noises in order: the first output is the n=1 image
    assert_same_image(double[:1], single)
    assert_different_image(double[:1], double[1:])


# -- parity and batch invariance ----------------------------------------------------


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_request_style_equals_step_style(pipe, guidance_scale):
    request = make_request(
        seed=11, num_inference_steps=3, guidance_scale=guidance_scale, negative_prompt="blurry"
    )
    by_request = run_request(pipe, request)[0]
    by_step = run_steps(pipe, [request])[request.request_id]
    assert_same_image(by_request, by_step)


def test_request_batch_does_not_change_an_image(pipe):
    alone = run_request(pipe, make_request(seed=3))[0]
    mates = [
        make_request(seed=4, prompt="a very long prompt about a blue boat at sea"),
        make_request(seed=3),
        make_request(seed=9, prompt=""),
    ]
    batched = run_request(pipe, mates[0], make_request(seed=3), mates[2])
    assert_same_image(batched[1], alone)
    assert_different_image(batched[0], alone)


def test_step_batch_with_different_step_counts_and_late_joiners(pipe):
    a = make_request(seed=21, num_inference_steps=3, guidance_scale=3.0)
    b = make_request(seed=22, num_inference_steps=2, guidance_scale=5.0, prompt="a ship")
    c = make_request(seed=23, num_inference_steps=4, guidance_scale=3.0, prompt="a tree")
    together = run_steps(pipe, [a, b, c], join_tick=[0, 1, 0])
    for request in (a, b, c):
        alone = run_request(pipe, request)[0]
        assert_same_image(together[request.request_id], alone)


def test_request_batch_with_cfg_matches_singles(pipe):
    a = make_request(seed=31, guidance_scale=4.0, negative_prompt="dark")
    b = make_request(seed=32, guidance_scale=4.0, prompt="a dog")
    batched = run_request(pipe, a, b)
    assert_same_image(batched[0], run_request(pipe, a)[0])
    assert_same_image(batched[1], run_request(pipe, b)[0])


# -- determinism, seeds, conditioning --------------------------------------------------


def test_deterministic_across_runs(pipe):
    first = run_request(pipe, make_request(seed=7))[0]
    second = run_request(pipe, make_request(seed=7))[0]
    assert torch.equal(first, second)


def test_different_seeds_give_different_images(pipe):
    assert_different_image(
        run_request(pipe, make_request(seed=1))[0], run_request(pipe, make_request(seed=2))[0]
    )


def test_missing_seed_draws_a_random_one(pipe):
    first = run_request(pipe, make_request(seed=None))[0]
    second = run_request(pipe, make_request(seed=None))[0]
    assert_different_image(first, second)
    state = StepRequestState(make_request(seed=None))
    pipe.prepare_encode(state)
    assert isinstance(state.seed, int)


def test_prompt_conditions_the_image(pipe):
    # the tiny folders scale their prompt weights up so that this shows
    # (each family's models/tiny module's PROMPT_BOOST): 20/255 and more on average
    assert_different_image(
        run_request(pipe, make_request(prompt="a red fox"))[0],
        run_request(pipe, make_request(prompt="an old castle"))[0],
        min_mean=5.0,
    )


@pytest.mark.parametrize("style", ["request", "step"])
def test_cfg_on_and_off(pipe, style):
    def run(request):
        if style == "request":
            return run_request(pipe, request)[0]
        return run_steps(pipe, [request])[request.request_id]

    plain = run(make_request(guidance_scale=1.0))
    # CFG off: the negative prompt is not used at all
    assert torch.equal(plain, run(make_request(guidance_scale=1.0, negative_prompt="ugly")))
    guided = run(make_request(guidance_scale=5.0))
    assert_different_image(plain, guided)
    # CFG on: the negative prompt steers the image
    assert_different_image(guided, run(make_request(guidance_scale=5.0, negative_prompt="ugly")))


def test_cfg_doubles_the_transformer_batch(pipe, monkeypatch):
    rows = []
    original = pipe.transformer_forward

    def spy(latents, *args):
        rows.append(latents.shape[0])
        return original(latents, *args)

    monkeypatch.setattr(pipe, "transformer_forward", spy)
    run_request(
        pipe, make_request(guidance_scale=3.0, num_inference_steps=1, num_outputs_per_prompt=2)
    )
    run_request(
        pipe, make_request(guidance_scale=1.0, num_inference_steps=1, num_outputs_per_prompt=2)
    )
    assert rows == [4, 2]


def test_noise_scheduler_state_is_per_request(pipe):
    template_timesteps = pipe.noise_scheduler.timesteps.clone()
    a, b = (
        StepRequestState(make_request(num_inference_steps=2)),
        StepRequestState(make_request(num_inference_steps=5)),
    )
    pipe.prepare_encode(a)
    pipe.prepare_encode(b)
    assert a.noise_scheduler is not b.noise_scheduler
    assert a.noise_scheduler is not pipe.noise_scheduler
    assert len(a.timesteps) == 2 and len(b.timesteps) == 5
    run_request(pipe, make_request(num_inference_steps=3))
    assert torch.equal(pipe.noise_scheduler.timesteps, template_timesteps)


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("height", {"height": 100}),
        ("height", {"height": 0}),
        ("width", {"width": 4096}),
        ("num_inference_steps", {"num_inference_steps": 0}),
        ("guidance_scale", {"guidance_scale": float("nan")}),
        ("num_outputs_per_prompt", {"num_outputs_per_prompt": 0}),
        ("seed", {"seed": "7"}),
        ("loras", {"loras": {"watercolour": float("nan")}}),
    ],
)
def test_invalid_params_raise_before_compute(pipe, monkeypatch, field, params):
    def no_compute(*args, **kwargs):
        raise AssertionError("compute ran before validation")

    monkeypatch.setattr(pipe, "transformer_forward", no_compute)
    monkeypatch.setattr(pipe, "prepare_latents", no_compute)
    request = make_request(**params)
    with pytest.raises(InvalidRequestError) as info:
        pipe.spec.check(request)
    assert info.value.field == field
    with pytest.raises(InvalidRequestError):
        run_request(pipe, make_request(), request)
    with pytest.raises(InvalidRequestError):
        pipe.prepare_encode(StepRequestState(request))


def test_tiny_sd3_size_is_bounded_by_its_position_grid():
    spec = resolve_model_spec("tiny-sd3")
    spec.check(make_request(height=512, width=512))
    with pytest.raises(InvalidRequestError, match="512"):
        spec.check(make_request(height=528))


def test_incompatible_batches_are_refused(pipe):
    with pytest.raises(ValueError, match="request_batch_key"):
        run_request(pipe, make_request(num_inference_steps=2), make_request(num_inference_steps=3))
    # sizes share a step where the family pads rows (Flux, SD3), not elsewhere;
    # CFG and no CFG never do (one call runs both branches for all its rows or
    # none): ``guidance_scale`` 1 runs no CFG in either family, 5 runs it in both
    other = {"guidance_scale": 5.0} if pipe.spec.mixed_sizes else {"height": 2 * SIZE}
    a = StepRequestState(make_request(guidance_scale=1.0))
    b = StepRequestState(make_request(**other))
    pipe.prepare_encode(a)
    pipe.prepare_encode(b)
    with pytest.raises(ValueError, match="step_batch_key"):
        pipe.denoise_step([a, b])


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3"])
def test_bfloat16_runs_both_styles(model):
    from diffrt.engine.pipelines import load_pipeline

    pipe = load_pipeline(model, dtype=torch.bfloat16)
    request = make_request(num_inference_steps=2, guidance_scale=2.0, height=32, width=32)
    out = run_request(pipe, request)[0]
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, 32, 32)
    assert_same_image(out.float(), run_steps(pipe, [request])[request.request_id].float())


@pytest.mark.parametrize("output_type", ["pt", "latent"])
def test_each_output_owns_its_storage(pipe, output_type):
    outs = run_request(
        pipe,
        make_request(seed=1, output_type=output_type, num_inference_steps=1),
        make_request(seed=2, output_type=output_type, num_inference_steps=1),
    )
    for out in outs:
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
