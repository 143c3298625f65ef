"""``vae_tiling`` on video: the Wan pipeline's ``AutoencoderKLWan`` decodes
in diffusers' own tiles (``enable_tiling``: spatial tiles of 256 px at a
192 px stride, blended, each decoded frame by frame with its causal frame
cache), so a clip larger than a tile equals diffusers' ``WanPipeline`` with
tiling enabled within 2/255 per frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

diffusers = pytest.importorskip("diffusers")

#: a side past one tile (256 px: 32 latent rows), so the decode is tiled
SIDE, FRAMES, STEPS = 288, 5, 2


def test_tiled_decode_matches_diffusers_enable_tiling():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's CPU workers run
    try:
        theirs = diffusers.WanPipeline.from_pretrained(embedded_folder("tiny-wan"),
                                                       local_files_only=True)
        theirs.set_progress_bar_config(disable=True)
        theirs.vae.enable_tiling()
        ours = load_pipeline("tiny-wan")
        ours.configure_memory(vae_tiling=True)
        want = theirs(prompt="a red fox", num_frames=FRAMES, height=SIDE, width=SIDE,
                      num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(0),
                      output_type="latent").frames
        r = DiffusionRequest(prompt="a red fox", request_id="tiled", sampling_params=SamplingParams(
            seed=0, num_frames=FRAMES, height=SIDE, width=SIDE, num_inference_steps=STEPS))
        got = ours.forward(DiffusionRequestBatch([r]))[0]
        # diffusers' own decode of its latents, tiled and not
        mean = torch.tensor(theirs.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(theirs.vae.config.latents_std).view(1, -1, 1, 1, 1)
        tiled = theirs.vae.decode(want * std + mean, return_dict=False)[0]
        theirs.vae.disable_tiling()
        whole = theirs.vae.decode(want * std + mean, return_dict=False)[0]
    finally:
        torch.set_num_threads(threads)
    assert ours.vae.use_tiling and got.shape == (1, 3, FRAMES, SIDE, SIDE)
    levels = [quantize_images(v.clamp(-1, 1))[0].numpy().astype(np.int16)
              for v in (got, tiled, whole)]
    assert np.abs(levels[0] - levels[1]).max() <= 2
    assert np.abs(levels[1] - levels[2]).max() > 2  # the tiles' blend shows: tiling ran
