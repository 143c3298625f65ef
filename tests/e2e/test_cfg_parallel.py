"""CFG parallel through the whole engine: two worker ranks (gloo on loopback)
split classifier-free guidance's branches; the images equal one rank's."""

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


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_cfg_parallel_matches_one_rank_batched(step, reference):
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-sd3", world_size=2, cfg_parallel_size=2, step_execution=step,
            max_num_seqs=2, executor_options={"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}},
    )) as engine:
        got = pixels(engine.generate(requests("cfg"), timeout=120))
    for a, b in zip(got, reference, strict=True):
        assert np.abs(a - b).max() <= 1  # two one-branch forwards vs one two-row forward
