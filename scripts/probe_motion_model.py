"""Two measurements of a ``diffrt-motion`` folder that say why its clips miss their motion.

    .venv/bin/python scripts/probe_motion_model.py                      # the shipped folder
    .venv/bin/python scripts/probe_motion_model.py /tmp/motion --noises 8

1. **Where the transformer puts the shape from the prompt alone.** Its
   clean-clip estimate at sigma 1 (pure noise in, ``noise - v`` out),
   averaged over ``--noises`` noises, decoded, for "a red circle <motion> on
   a yellow background" and each motion; per frame, the centroid of the
   pixels nearer red than yellow (weighted by how much nearer). Wan's
   transformer sees token positions only relative to each other, so unless
   it has learnt the grid's edges the centroid is the same for every motion;
   a Helios folder's transformer is given its first chunk's zero history,
   as HeliosPipeline gives it, and can tell where a token is from it.
2. **Whether the VAE gives one picture one code.** Still clips (one frame
   repeated) through the folder's VAE, latents normalised as the pipeline
   does: each latent frame's mean magnitude, and its mean squared distance
   from the last latent frame. A causal VAE that encodes the first frame
   alone can give each latent frame its own code for the same picture,
   which a transformer that cannot tell frames apart by index cannot draw.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from diffrt.demo import motion
from diffrt.demo.shapes import PALETTE
from diffrt.engine.pipelines.helios.history import first_chunk_inputs


def normaliser(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and spread, shaped as the pipeline applies them."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean).view(shape),
            torch.tensor(vae.config.latents_std).view(shape))


def centroids(pipe, noises: int) -> None:
    vae, transformer = pipe.vae, pipe.transformer
    import diffusers

    helios = isinstance(pipe, diffusers.HeliosPipeline)
    channels = vae.config.z_dim
    mean, std = normaliser(vae)
    latent_frames = (motion.FRAMES - 1) // vae.config.scale_factor_temporal + 1
    side = 64 // vae.config.scale_factor_spatial
    red, yellow = (np.array(PALETTE[c], np.float32) for c in ("red", "yellow"))
    ys, xs = np.mgrid[:64, :64]
    print("1. the shape's centroid in the estimate from pure noise, frame by frame")
    for direction in motion.DIRECTIONS:
        prompt = motion.Clip("circle", "red", "yellow", direction).prompt
        embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False,
                                       max_sequence_length=16)
        estimates = []
        for seed in range(noises):
            noise = torch.randn(1, channels, latent_frames, side, side,
                                generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                v = transformer(hidden_states=noise, timestep=torch.tensor([1000.0]),
                                encoder_hidden_states=embeds, return_dict=False,
                                **(first_chunk_inputs(noise) if helios else {}))[0]
            estimates.append(noise - v)
        with torch.no_grad():
            video = vae.decode(torch.stack(estimates).mean(0) * std + mean).sample[0]
        frames = ((video.clamp(-1, 1) + 1) * 127.5).permute(1, 2, 3, 0).numpy()
        nearer = (np.linalg.norm(frames - yellow, axis=-1) - np.linalg.norm(frames - red, axis=-1))
        weight = np.clip(nearer / 255 + 0.5, 0, None)
        x = [(w * xs).sum() / w.sum() for w in weight]
        y = [(w * ys).sum() / w.sum() for w in weight]
        print(f"  {direction:>14}: x " + " ".join(f"{v:3.0f}" for v in x)
              + "   y " + " ".join(f"{v:3.0f}" for v in y))
    truth = motion.render(motion.Clip("circle", "red", "yellow", "left to right"))
    plain = [np.argwhere((f == PALETTE["red"]).all(-1)).mean(0)[1] for f in truth]
    print("  (a plain 'left to right' clip: x " + " ".join(f"{v:3.0f}" for v in plain) + ")")


def codes(vae) -> None:
    mean, std = normaliser(vae)
    rng = np.random.default_rng(0)
    stills = []
    for clip in motion.EVALUATION:
        frame = motion.random_render(clip, rng)[rng.integers(motion.FRAMES)]
        stills.append(np.repeat(frame[None], motion.FRAMES, 0))
    batch = torch.from_numpy(np.stack(stills)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    with torch.no_grad():
        z = (vae.encode(batch).latent_dist.mode() - mean) / std
    magnitude = z.abs().mean((0, 1, 3, 4))
    distance = (z - z[:, :, -1:]).pow(2).mean((0, 1, 3, 4))
    print("2. still clips' latent frames (normalised): mean magnitude "
          + " ".join(f"{v:.2f}" for v in magnitude)
          + "; mean squared distance from the last " + " ".join(f"{v:.2f}" for v in distance))


def main() -> None:
    import diffusers

    from diffrt.engine.models.shipped import shipped_folder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default=None, help="default: the shipped diffrt-motion")
    ap.add_argument("--noises", type=int, default=8)
    args = ap.parse_args()
    folder = str(args.folder or shipped_folder("diffrt-motion"))
    torch.set_num_threads(2)
    # the folder's own pipeline class (WanPipeline for the runs before the
    # eleventh, HeliosPipeline since)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True,
                                                       torch_dtype=torch.float32)
    centroids(pipe, args.noises)
    codes(pipe.vae.eval())


if __name__ == "__main__":
    main()
