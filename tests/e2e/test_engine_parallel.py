"""Parallelism through the whole engine, two worker ranks (gloo on loopback):
CFG parallel splits guidance's branches, Ulysses the image tokens; the
images equal one rank's."""

from __future__ import annotations

import numpy as np
import pytest

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams


def requests(tag: str) -> list[DiffusionRequest]:
    return [DiffusionRequest(prompt=f"a lighthouse {i}", request_id=f"{tag}-{i}",
                             negative_prompt="blurry",
                             sampling_params=SamplingParams(height=64, width=64,
                                                            num_inference_steps=s, seed=i,
                                                            guidance_scale=5.0))
            for i, s in ((1, 3), (2, 2))]


def pixels(outs) -> list[np.ndarray]:
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [np.asarray(o.images[0]).astype(np.int16) for o in outs]


@pytest.fixture(scope="module")
def reference():
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-sd3", executor_backend="inproc",
                                                  max_num_seqs=2)) as engine:
        yield pixels(engine.generate(requests("ref"), timeout=120))


def on_two_ranks(batch: list[DiffusionRequest], **config) -> list[np.ndarray]:
    """``batch`` through an engine of two worker ranks (gloo on loopback)."""
    with DiffusionEngine.make_engine(EngineConfig(
            world_size=2, max_num_seqs=2,
            executor_options={"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}}, **config)) as engine:
        return pixels(engine.generate(batch, timeout=120))


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_cfg_parallel_matches_one_rank_batched(step, reference):
    got = on_two_ranks(requests("cfg"), model="tiny-sd3", cfg_parallel_size=2,
                       step_execution=step)
    for a, b in zip(got, reference, strict=True):
        assert np.abs(a - b).max() <= 1  # two one-branch forwards vs one two-row forward


def flux_requests(tag: str) -> list[DiffusionRequest]:
    return [DiffusionRequest(prompt=f"a red fox {i}", request_id=f"{tag}-{i}",
                             sampling_params=SamplingParams(height=64, width=64,
                                                            num_inference_steps=s, seed=i))
            for i, s in ((1, 3), (2, 2))]


@pytest.fixture(scope="module")
def flux_reference():
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-flux", executor_backend="inproc",
                                                  max_num_seqs=2)) as one:
        yield pixels(one.generate(flux_requests("ref"), timeout=120))


@pytest.mark.parametrize("method,step", [("ulysses_degree", False), ("ulysses_degree", True),
                                         ("ring_degree", True)])
def test_sequence_parallel_flux_matches_one_rank_batched(method, step, flux_reference):
    """tiny-flux with its image tokens split over two ranks (Ulysses, ring):
    the images equal one rank's."""
    got = on_two_ranks(flux_requests("sp"), model="tiny-flux", step_execution=step,
                       **{method: 2})
    for a, b in zip(got, flux_reference, strict=True):
        assert np.abs(a - b).max() <= 1
