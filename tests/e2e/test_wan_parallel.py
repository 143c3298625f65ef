"""Wan over several worker ranks, gloo on loopback: CFG parallel (text- and
image-to-video, Wan 2.2's two experts: 2 steps run one on each) with the
decode in bands of every frame's rows (``vae_parallel``), and Ulysses over
the video tokens; each clip's frames equal one rank's within 1/255. Ring
attention over the tokens and the banded decode's edge cases run in the
shared gloo group of tests/engine/test_parallel_layers.py."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

LOOPBACK = {"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}}
FIRST = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))


def clips(tag: str, *, i2v: bool = False) -> list[DiffusionRequest]:
    """A clip, and one of other frames and size (a step batch runs it in its
    own call); 2 steps: the first on the high-noise expert, the second on the
    low-noise one. Image-to-video: the first frame given, at 64² each."""
    images = [FIRST] if i2v else []
    return [DiffusionRequest(prompt=f"a lighthouse {i}", request_id=f"{tag}-{i}",
                             negative_prompt="blurry", images=images,
                             sampling_params=SamplingParams(num_frames=frames, height=size,
                                                            width=size, seed=i,
                                                            num_inference_steps=2))
            for i, frames, size in ((1, 9, 64), (2, 5, 64 if i2v else 48))]


def frames(outs) -> list[np.ndarray]:
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [np.stack([np.asarray(f) for f in o.frames[0]]).astype(np.int16) for o in outs]


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1


def generate(batch: list[DiffusionRequest], **config) -> list[np.ndarray]:
    with DiffusionEngine.make_engine(EngineConfig(max_num_seqs=2, warmup=False,
                                                  **config)) as engine:
        return frames(engine.generate(batch, timeout=300))


@pytest.fixture(scope="module")
def one_rank():
    """Each model's clips from one rank, in-process."""
    return {model: generate(clips("ref", i2v=model == "tiny-wan-i2v"), model=model,
                            executor_backend="inproc")
            for model in ("tiny-wan", "tiny-wan-i2v")}


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-wan-i2v"])
def test_cfg_parallel_with_banded_decode_matches_one_rank(model, one_rank):
    """Two ranks, step mode: each computes one guidance branch of every step
    (both experts), then decodes a band of each frame's rows."""
    got = generate(clips("cfg", i2v=model == "tiny-wan-i2v"), model=model, cfg_parallel_size=2,
                   vae_parallel=True, step_execution=True, **LOOPBACK)
    assert_close(got, one_rank[model])


def test_ulysses_over_video_tokens_matches_one_rank(one_rank):
    """Two ranks, request mode: each holds half of every clip's frames x
    tokens, the attention heads exchanged for them (2 heads: 1 each)."""
    got = generate(clips("ulysses"), model="tiny-wan", ulysses_degree=2, **LOOPBACK)
    assert_close(got, one_rank["tiny-wan"])
