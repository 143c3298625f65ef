"""Image-to-video requests of different frame counts sharing steps: each
row's first-frame condition tokens are as long as its own clip's (a step
carries them zero-padded to the longest row's; a call of one size takes its
own), so each clip equals its run alone."""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch
from pipeline_steps import stepped

from diffrt.engine.pipelines import load_pipeline
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams


def test_first_frame_clips_of_two_frame_counts_step_together_as_alone():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's CPU workers run
    try:
        pipe = load_pipeline("tiny-wan-i2v")
        first = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255)
                                    .astype(np.uint8))
        clips = [DiffusionRequest(prompt="a red fox", request_id=f"i2v-{frames}", images=[first],
                                  sampling_params=SamplingParams(seed=1, num_frames=frames,
                                                                 num_inference_steps=2))
                 for frames in (9, 5)]
        alone = [stepped(pipe, [r])[0] for r in clips]
        together = stepped(pipe, clips)
    finally:
        torch.set_num_threads(threads)
    assert [v.shape[2] for v in together] == [9, 5]
    for solo, shared in zip(alone, together, strict=True):
        a, b = (quantize_images(v).numpy().astype(np.int16) for v in (solo, shared))
        assert np.abs(a - b).max() <= 1
