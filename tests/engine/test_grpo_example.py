"""examples/grpo_shapes.py's pieces (docs/rollouts.md, "The example loop"),
on a small in-process diffrt-shapes engine with the example's LoRA:

- rollouts match training: the trainer's log-probs, recomputed with
  gradients by diffusers' transformer and peft's LoRA on the trajectory diffrt
  returned, equal diffrt's for every step (within the example's MATCH_ATOL),
  with a non-zero adapter;
- one iteration trains (the LoRA moves), calls ``update_lora``, and the next
  rollout runs on the new version and still matches the trainer;
- the benchmark's diffusers arm (benchmarks/bench_rollouts.py: FluxPipeline
  with its scheduler's step replaced by the SDE step) draws the samples
  diffrt draws from the same seeds, so its throughput is for the same work;
- the reward rule and the group advantages.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


grpo = load("examples/grpo_shapes.py")
PROMPTS = grpo.PROMPTS[:1]
STEPS = 3


@pytest.fixture(scope="module")
def policy():
    policy = grpo.Policy(PROMPTS, rank=4, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 would make the adapter change nothing: make it count
        for p in policy.parameters:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return policy


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    folder = policy.save(str(tmp_path_factory.mktemp("grpo") / "adapter"))
    with grpo.make_engine(folder, PROMPTS, executor_backend="inproc", warmup=False) as e:
        yield e


def trainer_log_probs(policy, rolls) -> torch.Tensor:
    """(P * G, T): every step's log-prob as the trainer computes it."""
    p, g, t = rolls.log_probs.shape
    latents = rolls.latents.reshape(p * g, *rolls.latents.shape[2:])
    index = torch.arange(p).repeat_interleave(g)
    sigmas = [float(s) for s in rolls.sigmas]
    with torch.no_grad():
        return torch.stack([policy.log_prob(index, latents[:, k], latents[:, k + 1],
                                            float(rolls.timesteps[k]), sigmas[k],
                                            sigmas[k + 1], sigmas[1]) for k in range(t)], dim=1)


def test_the_trainers_log_probs_equal_diffrts(policy, engine):
    rolls = grpo.rollout(engine, PROMPTS, [[5, 6]], STEPS)
    assert rolls.log_probs.shape == (1, 2, STEPS) and rolls.lora_versions == [0]
    mine = trainer_log_probs(policy, rolls)
    assert torch.allclose(mine, rolls.log_probs.reshape(2, STEPS), atol=grpo.MATCH_ATOL, rtol=0)
    # not by accident: another noise level's transition is another density
    sigmas = [float(s) for s in rolls.sigmas]
    with torch.no_grad():
        other = policy.log_prob(torch.zeros(2, dtype=torch.long), rolls.latents[0, :, 1],
                                rolls.latents[0, :, 2], float(rolls.timesteps[1]), sigmas[1],
                                sigmas[2], sigmas[1], noise_level=0.5)
    assert (other - rolls.log_probs[0, :, 1]).abs().min() > 100 * grpo.MATCH_ATOL


def test_one_iteration_trains_and_updates_the_adapter(policy, engine):
    before = [p.detach().clone() for p in policy.parameters]
    optimizer = torch.optim.AdamW(policy.parameters, lr=1e-3)
    args = argparse.Namespace(steps=STEPS, train_steps=2, minibatches=1, clip_range=1e-3)
    record, rolls = grpo.iteration(engine, policy, optimizer, PROMPTS, [[7, 8, 9]], args,
                                   torch.Generator().manual_seed(0))
    assert record["match_gap"] <= grpo.MATCH_ATOL  # the example asserts it too
    assert record["rolled_on"] == 0 and record["lora_version"] == 1
    assert len(rolls.images[0]) == 3 and 0 < record["reward"] <= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters, strict=True))
    after = grpo.rollout(engine, PROMPTS, [[5, 6]], STEPS)
    assert after.lora_versions == [1]
    # the engine rolls out with exactly the factors the trainer holds now
    assert torch.allclose(trainer_log_probs(policy, after), after.log_probs.reshape(2, STEPS),
                          atol=grpo.MATCH_ATOL, rtol=0)


def test_the_benchmarks_diffusers_rollout_draws_diffrts_samples(engine):
    bench = load("benchmarks/bench_rollouts.py")
    pipe = bench.diffusers_pipeline({})
    _, log_probs, latents = bench.diffusers_rollout(pipe, PROMPTS[0], None, [3, 4], 2)
    from diffrt.engine import DiffusionRequest, SamplingParams

    out = engine.generate(DiffusionRequest(prompt=PROMPTS[0], sampling_params=SamplingParams(
        num_outputs_per_prompt=2, seeds=[3, 4], num_inference_steps=2, sampler="flow-sde",
        noise_level=bench.NOISE_LEVEL, return_log_probs=True, return_trajectory=True)))
    assert out.ok, out.error
    assert log_probs.shape == out.rollout.log_probs.shape == (2, 2)
    assert latents.shape[:2] == (2, 3)
    assert torch.allclose(log_probs, out.rollout.log_probs, atol=1e-4, rtol=0)


def picture(colour: tuple[int, int, int] | None, side: int = 22) -> Image.Image:
    image = Image.new("RGB", (64, 64), (245, 245, 245))
    if colour is not None:
        ImageDraw.Draw(image).ellipse((20, 20, 20 + side, 20 + side), fill=colour)
    return image


def test_the_reward_is_the_shapes_hue_closeness_to_teal_at_its_size():
    full = int(grpo.core(picture((0, 0, 0))).sum())
    teal, green, yellow, red = (grpo.reward(picture(c), full) for c in (
        (0, 200, 200), (30, 170, 60), (240, 220, 40), (220, 30, 30)))
    assert teal > 0.99 and teal > green > yellow > red >= 0
    assert red < 0.01  # opposite teal on the hue circle
    assert grpo.reward(picture(None), full) == 0.0
    small = grpo.reward(picture((0, 200, 200), side=14), full)
    assert 0 < small < 0.75 * teal  # drawn smaller than 3/4 of its size: paid less
    # the prompts' own scenes, drawn clean, have cores to measure against
    assert all(grpo.full_size(p) > 50 for p in grpo.PROMPTS)


def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.8]])
    adv = grpo.group_advantages(rewards)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert adv[0].argmax() == 2 and adv[1, 2] > 0 > adv[1, 0] == adv[1, 1]
