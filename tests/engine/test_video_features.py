"""The features that run on video, through the engine (in-process executor)
on tiny-wan: step caches (threshold 0 gives the uncached frames, a high
threshold reuses steps, a cached request step-batched with another decides
as it does alone)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import assert_clean, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

pytest.importorskip("diffusers")

#: 6 steps: the tiny folder's 4 leave TeaCache too few to skip after its first
STEPS = 6


def clip_request(seed: int, **params) -> DiffusionRequest:
    params.setdefault("num_inference_steps", STEPS)
    return DiffusionRequest(prompt=f"a red fox {seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


@pytest.fixture(scope="module")
def step():
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model="tiny-wan", executor_backend="inproc", warmup=False, step_execution=True,
            max_num_seqs=4))) as engine:
        yield engine


def clip(out) -> np.ndarray:
    assert out.ok, out.error
    return np.stack([np.asarray(f) for f in out.frames[0]]).astype(np.int16)


@pytest.mark.parametrize("policy,threshold", [("first-block", 0.9), ("teacache", 2.0)])
def test_a_cached_clip_at_threshold_zero_is_the_uncached_one_and_a_high_one_reuses(
        step, policy, threshold):
    plain = clip(step.generate(clip_request(5)))
    exact = step.generate(clip_request(5, cache=policy, cache_threshold=0.0))
    assert exact.metrics.cache.policy == policy
    assert exact.metrics.cache.steps_reused == 0
    assert np.array_equal(clip(exact), plain)
    cached = step.generate(clip_request(5, cache=policy, cache_threshold=threshold))
    assert cached.metrics.cache.steps_reused > 0
    assert cached.metrics.cache.steps_computed + cached.metrics.cache.steps_reused == STEPS
    assert np.abs(clip(cached) - plain).max() > 1
    assert_clean(step)


@pytest.mark.parametrize("policy,threshold", [("first-block", 0.9), ("teacache", 2.0)])
def test_a_cached_clip_step_batched_with_another_decides_as_alone(step, policy, threshold):
    cached = clip_request(6, cache=policy, cache_threshold=threshold)
    other = clip_request(7, num_frames=5, num_inference_steps=4)
    alone = step.generate(cached)
    together = step.generate([cached, other])
    assert alone.metrics.cache.steps_reused > 0
    assert together[0].metrics.cache.reused_steps == alone.metrics.cache.reused_steps
    assert np.abs(clip(together[0]) - clip(alone)).max() <= 1
    assert together[1].metrics.cache is None
    assert_clean(step)
