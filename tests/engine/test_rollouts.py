"""Rollouts (docs/rollouts.md): Flow-GRPO's SDE step with per-step log-probs
and trajectories, and seeds per output.

The log-probs are checked against a float64 computation written here from
the paper's formula (Flow-GRPO, eq. 9 and its Gaussian transition), with the
velocity computed by diffusers' own StableDiffusion3Pipeline components on
the returned trajectory: an independent path from the engine's. The
trajectory's last latents decode (diffusers' VAE) to the returned images. A
rollout batched with others (other sizes, LoRA rows, the default sampler)
equals its run alone, in both execution modes.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from engine_helpers import assert_shared_steps
from lora_files import make_adapter

from diffrt.engine import (
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    InvalidRequestError,
    SamplingParams,
)
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES
from diffrt.engine.request import new_request_id

PROMPT = "a red square on a blue field"


def rollout_request(prompt: str = PROMPT, *, seed: int | None = 3, steps: int = 4,
                    size: int = 64, n: int = 2, **kw) -> DiffusionRequest:
    params = dict(height=size, width=size, num_inference_steps=steps, num_outputs_per_prompt=n,
                  sampler="flow-sde", return_log_probs=True, return_trajectory=True)
    params.update(kw)
    if "seeds" not in params:
        params["seed"] = seed
    return DiffusionRequest(prompt=prompt, sampling_params=SamplingParams(**params))


def engine(model: str, **kw) -> DiffusionEngine:
    return DiffusionEngine.make_engine(EngineConfig(
        model=model, executor_backend="inproc", warmup=False, **kw))


# -- the float64 reference, from the paper ---------------------------------------------------
def reference_log_prob(x: torch.Tensor, v: torch.Tensor, x_next: torch.Tensor, sigma: float,
                       sigma_next: float, sigma_1: float, a: float) -> torch.Tensor:
    """log N(x_next; mean, std^2 I) of one Flow-GRPO step, per row, as the
    per-element mean (Flow-GRPO's convention), all in float64:
    s = a sqrt(sigma / (1 - sigma)), mean = x + [v + s^2/(2 sigma) (x + (1 - sigma) v)] dt,
    std = s sqrt(-dt)."""
    x, v, x_next = x.double(), v.double(), x_next.double()
    dt = sigma_next - sigma
    s = a * math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
    mean = x + (v + s * s / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    std = s * math.sqrt(-dt)
    density = -((x_next - mean) ** 2) / (2 * std * std) - math.log(std) \
        - 0.5 * math.log(2 * math.pi)
    return density.flatten(1).mean(dim=1)


@pytest.fixture(scope="module")
def sd3():
    with engine("tiny-sd3", step_execution=True, max_num_seqs=4) as e:
        yield e


@pytest.fixture(scope="module")
def diffusers_sd3():
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(embedded_folder("tiny-sd3"),
                                                    local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_each_log_prob_equals_the_papers_transition_in_float64(sd3, diffusers_sd3):
    """Batched with a default-sampler request, every step's log-prob of both
    outputs equals the float64 reference within 1e-5; the sigmas are the
    diffusers scheduler's; the last latents decode to the returned images."""
    rollout, plain = sd3.generate([
        rollout_request(guidance_scale=1.0, noise_level=0.8),
        DiffusionRequest(prompt="another", sampling_params=SamplingParams(
            height=64, width=64, num_inference_steps=3, seed=1, guidance_scale=1.0))])
    assert rollout.ok and plain.ok, (rollout.error, plain.error)
    r = rollout.rollout
    assert r is not None and plain.rollout is None
    steps = 4
    assert r.log_probs.shape == (2, steps) and r.log_probs.dtype == torch.float32
    assert r.latents.shape[:2] == (2, steps + 1) and r.timesteps.shape == (steps,)
    scheduler = diffusers_sd3.scheduler
    scheduler.set_timesteps(steps)
    assert torch.equal(r.sigmas, scheduler.sigmas.float())
    assert torch.allclose(r.timesteps, scheduler.timesteps.float())
    pipe = diffusers_sd3
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPT, None, None, device="cpu",
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=256)
        for k in range(steps):
            x = r.latents[:, k]
            v = pipe.transformer(hidden_states=x, timestep=r.timesteps[k].expand(2),
                                 encoder_hidden_states=embeds.expand(2, -1, -1),
                                 pooled_projections=pooled.expand(2, -1), return_dict=False)[0]
            want = reference_log_prob(x, v, r.latents[:, k + 1], float(r.sigmas[k]),
                                      float(r.sigmas[k + 1]), float(r.sigmas[1]), 0.8)
            assert torch.allclose(r.log_probs[:, k].double(), want, atol=1e-5, rtol=0), (
                k, r.log_probs[:, k], want)
        vae = pipe.vae
        last = r.latents[:, -1] / vae.config.scaling_factor + vae.config.shift_factor
        decoded = vae.decode(last, return_dict=False)[0]
    pixels = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    returned = np.stack([np.asarray(image) for image in rollout.images])
    assert np.abs(pixels.numpy().astype(int) - returned.astype(int)).max() <= 1


def test_the_sde_draws_noise_and_the_default_sampler_does_not(sd3):
    """flow-sde gives other pictures than the ODE from the same first noise
    (same seed, same first latents), two outputs differ, and a repeat is
    bit-identical (the noise is the request's own)."""
    sde, again, ode = sd3.generate([
        rollout_request(guidance_scale=1.0),
        rollout_request(guidance_scale=1.0),
        rollout_request(guidance_scale=1.0, sampler="default", return_log_probs=False)])
    assert torch.equal(sde.rollout.latents, again.rollout.latents)
    assert torch.equal(sde.rollout.log_probs, again.rollout.log_probs)
    assert torch.equal(sde.rollout.latents[:, 0], ode.rollout.latents[:, 0])
    assert not torch.equal(sde.rollout.latents[:, -1], ode.rollout.latents[:, -1])
    assert not torch.equal(sde.rollout.latents[0], sde.rollout.latents[1])
    assert ode.rollout.log_probs is None


def test_request_mode_equals_step_mode(sd3):
    """REQUEST_BATCH (a fused forward of two rollouts) gives what STEP_BATCH
    gives (within float32 reassociation: the calls' rows differ)."""
    requests = [rollout_request(guidance_scale=1.0), rollout_request("a cat", seed=9,
                                                                     guidance_scale=1.0)]
    stepped = sd3.generate([msgspec_copy(r) for r in requests])
    with engine("tiny-sd3", max_num_seqs=2) as whole:
        fused = whole.generate([msgspec_copy(r) for r in requests])
    for a, b in zip(stepped, fused, strict=True):
        assert a.ok and b.ok
        assert torch.allclose(a.rollout.log_probs, b.rollout.log_probs, atol=1e-5, rtol=0)
        assert torch.allclose(a.rollout.latents, b.rollout.latents, atol=1e-5, rtol=0)


def msgspec_copy(request: DiffusionRequest) -> DiffusionRequest:
    """The same request under a fresh id (one may run twice at once)."""
    return msgspec.structs.replace(request, request_id=new_request_id())


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = embedded_folder("tiny-flux")
    adapter = make_adapter(folder, "FluxPipeline", tmp_path_factory.mktemp("lora") / "a",
                           targets=LORA_TARGET_MODULES, rank=4, seed=1)
    # share_steps="always": rows of other sizes share a step whatever the cost
    # model predicts, since what a shared step computes is what is tested
    with engine("tiny-flux", step_execution=True, max_num_seqs=8, share_steps="always",
                lora_modules={"a": adapter}) as e:
        yield e


def test_batched_with_sizes_and_adapters_equals_alone(flux):
    """A rollout with a LoRA row shares steps with others of other sizes,
    another adapter scale and the default sampler; each equals its run alone
    (log-probs within float32 reassociation, latents within 1e-4)."""
    mates = [
        rollout_request("a green circle", seed=5, loras={"a": 1.0}),
        rollout_request("a blue star", seed=6, size=96, n=1, steps=3),
        DiffusionRequest(prompt="plain", sampling_params=SamplingParams(
            height=128, width=64, num_inference_steps=4, seed=7)),
        rollout_request("a yellow moon", seed=8, loras={"a": 0.5}, return_trajectory=False),
    ]
    alone = [flux.generate(msgspec_copy(r)) for r in mates]
    before = flux.stats().step_batch_rows
    batched = flux.generate([msgspec_copy(r) for r in mates])
    assert_shared_steps(before, flux.stats().step_batch_rows, 2 + 1 + 1 + 2, 4)
    for a, b in zip(batched, alone, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        if b.rollout is None:
            continue
        assert torch.allclose(a.rollout.log_probs, b.rollout.log_probs, atol=1e-4, rtol=0)
        if b.rollout.latents is not None:
            assert torch.allclose(a.rollout.latents, b.rollout.latents, atol=1e-4, rtol=0)
    assert batched[3].rollout.latents is None and batched[3].rollout.log_probs is not None
    assert batched[1].rollout.log_probs.shape == (1, 3)
    assert batched[1].rollout.latents.shape[1] == 4


def test_seeds_give_each_output_its_own_noise(flux):
    """seeds=[a, b]: output i equals a request with seeds=[s_i] alone (its
    first latents, every SDE draw, its log-probs and image); seed=s and
    seeds=[s] are the same request; the output names its seeds."""
    pair = flux.generate(rollout_request(seeds=[11, 12]))
    second = flux.generate(rollout_request(seeds=[12], n=1))
    first = flux.generate(rollout_request(seed=11, n=1))
    assert pair.seeds == [11, 12] and pair.seed is None and first.seed == 11
    for i, solo in ((0, first), (1, second)):
        assert torch.allclose(pair.rollout.latents[i], solo.rollout.latents[0], atol=1e-5)
        assert torch.allclose(pair.rollout.log_probs[i], solo.rollout.log_probs[0], atol=1e-5)
        assert np.abs(np.asarray(pair.images[i]).astype(int)
                      - np.asarray(solo.images[0]).astype(int)).max() <= 1
    plain = flux.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
        height=64, width=64, num_inference_steps=4, seeds=[4, 5], num_outputs_per_prompt=2)))
    assert plain.ok and plain.rollout is None and plain.seeds == [4, 5]
    assert not np.array_equal(np.asarray(plain.images[0]), np.asarray(plain.images[1]))


@pytest.mark.parametrize(("fields", "named"), [
    ({"noise_level": 0.5}, "noise_level"),
    ({"return_log_probs": True}, "return_log_probs"),
    ({"seeds": [1]}, "seeds"),  # two outputs, one seed
    ({"seeds": [1, 2], "seed": 3}, "seeds"),
    ({"sampler": "flow-sde", "noise_level": 0.0}, "noise_level"),
])
def test_refusals_name_the_field(flux, fields, named):
    with pytest.raises(InvalidRequestError) as caught:
        flux.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
            height=64, width=64, num_outputs_per_prompt=2, **fields)))
    assert caught.value.field == named


def test_a_family_without_rollouts_refuses_them():
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.rollout_checks import check_rollout

    spec = resolve_model_spec("tiny-wan")
    with pytest.raises(InvalidRequestError) as caught:
        check_rollout(spec, spec.with_defaults(rollout_request(n=1)))
    assert caught.value.field == "sampler"


def test_deterministic_alone_equals_it_in_a_mixed_batch_of_eight(flux):
    """deterministic=True: a rollout alone and in a batch of 8 (other sizes,
    adapters, samplers, output counts) is bit-identical, images and
    log-probs; its mates still share their steps."""
    mine = rollout_request("a purple triangle", seed=21, loras={"a": 0.7}, deterministic=True)
    alone = flux.generate(msgspec_copy(mine))
    mates = [rollout_request(f"mate {i}", seed=30 + i, size=(64, 96, 128)[i % 3],
                             n=1 + i % 2, steps=3 + i % 2,
                             loras={"a": 1.0} if i % 2 else None,
                             sampler="flow-sde" if i % 3 else "default",
                             return_log_probs=bool(i % 3))
             for i in range(7)]
    together = flux.generate([msgspec_copy(mine), *[msgspec_copy(m) for m in mates]])
    assert all(o.ok for o in together), [o.error for o in together]
    got = together[0]
    assert torch.equal(got.rollout.log_probs, alone.rollout.log_probs)
    assert torch.equal(got.rollout.latents, alone.rollout.latents)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(got.images, alone.images, strict=True))


def test_an_engine_wide_batch_invariance_makes_every_request_deterministic():
    """``EngineConfig(batch_invariant=True)``: requests that do not ask for
    ``deterministic`` get it, so one alone and beside mates of its size is
    bit-identical, log-probs included (without the setting the batched
    calls change the last bits)."""
    with engine("tiny-flux", step_execution=True, max_num_seqs=8, share_steps="always",
                batch_invariant=True) as e:
        mine = rollout_request("a teal square", seed=5, steps=3)
        alone = e.generate(msgspec_copy(mine))
        # of its size, so a batched engine would compute their rows in its calls
        mates = [rollout_request(f"mate {i}", seed=40 + i, steps=3, n=1 + i % 2)
                 for i in range(5)]
        got = e.generate([msgspec_copy(mine), *mates])[0]
    assert got.ok and alone.ok, (got.error, alone.error)
    assert torch.equal(got.rollout.log_probs, alone.rollout.log_probs)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(got.images, alone.images, strict=True))
