"""Wan through the engine over two worker ranks, gloo on loopback: CFG
parallel (Wan 2.2's two experts: 2 steps run one on each) with the decode in
bands of every frame's rows (``vae_parallel``), and Ulysses over the video
tokens; each clip's frames equal one rank's within 1/255. Ring attention
over the tokens, the banded decode's edge cases and image-to-video under
CFG parallel run in the shared gloo groups of
tests/engine/test_parallel_layers.py (no engine each)."""

from __future__ import annotations

import numpy as np
import pytest

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

LOOPBACK = {"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}}


def clips(tag: str) -> list[DiffusionRequest]:
    """A clip, and one of other frames and size (a step batch runs it in its
    own call); 2 steps: the first on the high-noise expert, the second on the
    low-noise one."""
    return [DiffusionRequest(prompt=f"a lighthouse {i}", request_id=f"{tag}-{i}",
                             negative_prompt="blurry",
                             sampling_params=SamplingParams(num_frames=frames, height=size,
                                                            width=size, seed=i,
                                                            num_inference_steps=2))
            for i, frames, size in ((1, 9, 64), (2, 5, 48))]


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
    """The clips from one rank, in-process."""
    return generate(clips("ref"), model="tiny-wan", executor_backend="inproc")


def test_cfg_parallel_with_banded_decode_matches_one_rank(one_rank):
    """Two ranks, step mode: each computes one guidance branch of every step
    (both experts), then decodes a band of each frame's rows."""
    got = generate(clips("cfg"), model="tiny-wan", cfg_parallel_size=2, vae_parallel=True,
                   step_execution=True, **LOOPBACK)
    assert_close(got, one_rank)


def test_ulysses_over_video_tokens_matches_one_rank(one_rank):
    """Two ranks, request mode: each holds half of every clip's frames x
    tokens, the attention heads exchanged for them (2 heads: 1 each)."""
    got = generate(clips("ulysses"), model="tiny-wan", ulysses_degree=2, **LOOPBACK)
    assert_close(got, one_rank)
