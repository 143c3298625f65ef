"""The stripes family's pipeline on the flow-match contract (docs/families.md):
it supplies its encoders, its transformer call, its latent layout and its
decode — the spec is ``spec.py``'s — and the shared denoise loop, its
conditioning stages and the transformer call's feature layers do the rest,
in both execution modes.

- encoder (``ToneEncoder``): a prompt -> one token, its tone (crc32 of the
  text, in [0, 1)); no second text output (zeros);
- transformer (``Painter``): predicts the flow-matching velocity toward
  horizontal stripes — latent row ``r`` is ``colour * tone * (-1)^r``,
  scaled by the timestep, so the image depends on the seed's noise, the
  prompt, the weights and every step;
- latent layout (``StripeLatents``): 3 channels, one token a latent, a
  latent ``stripe`` pixels high and wide;
- decode (``StripesDecoder``): each latent a ``stripe x stripe`` block of
  pixels (the base class's ``decode_latents``: unpack, then the VAE).
"""

from __future__ import annotations

import os
import zlib

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import FrozenDict
from safetensors.torch import load_file

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.latents import SpatialLatents
from diffrt.engine.pipelines.segments import RowLayout

CHANNELS = 3


class ToneEncoder:
    """Prompts -> (embeds (n, 1, 1): the prompt's tone, extra (n, 1): zeros)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tones = [(zlib.crc32(p.encode()) % 100) / 100 for p in prompts]
        embeds = torch.tensor(tones, device=self.device).view(-1, 1, 1)
        return embeds, torch.zeros(len(prompts), 1, device=self.device)


class Painter(torch.nn.Module):
    """The family's transformer: tokens (rows, h * w, 3) -> velocity."""

    def __init__(self, colour: torch.Tensor):
        super().__init__()
        self.colour = torch.nn.Parameter(colour, requires_grad=False)

    def forward(self, tokens: torch.Tensor, timesteps: torch.Tensor, tones: torch.Tensor,
                size: tuple[int, int]) -> torch.Tensor:
        h, w = size
        sign = 1 - 2 * (torch.arange(h, device=tokens.device) % 2)
        stripes = sign.repeat_interleave(w).to(tokens.dtype)  # (h * w,), row-major
        scale = (1 + timesteps.to(tokens.dtype) / 1000).view(-1, 1, 1)
        target = (self.colour.view(1, 1, CHANNELS) * tones.view(-1, 1, 1)
                  * stripes.view(1, -1, 1) * scale)
        return tokens - target


class StripesDecoder(torch.nn.Module):
    """The family's "VAE": each latent a ``factor x factor`` block of pixels."""

    def __init__(self, factor: int):
        super().__init__()
        self.config = FrozenDict(latent_channels=CHANNELS, factor=factor)

    def decode(self, latents: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        factor = self.config["factor"]
        return (latents.repeat_interleave(factor, 2).repeat_interleave(factor, 3),)


class StripeLatents(SpatialLatents):
    """(N, 3, h, w) latents as rows of h * w tokens of 3 channels."""

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.flatten(2).transpose(1, 2)

    def unpack(self, tokens: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return tokens.transpose(1, 2).unflatten(2, size)


class StripesPipeline(FlowMatchPipeline):
    """Stripes on the shared denoise loop (see the module)."""

    transformer: Painter

    @classmethod
    def load(cls, spec: ModelSpec, *, device: torch.device,
             dtype: torch.dtype) -> StripesPipeline:
        weights = load_file(os.path.join(str(spec.folder), "painter", "painter.safetensors"))
        device = torch.device(device)
        pipeline = cls(Painter(weights["colour"].to(torch.float32)),
                       StripesDecoder(spec.size_multiple),
                       FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
                       ToneEncoder(device), device=device, dtype=torch.float32)
        pipeline.spec = spec
        return pipeline

    def latent_layout(self, vae_config: dict) -> StripeLatents:
        return StripeLatents(int(vae_config["latent_channels"]), int(vae_config["factor"]))

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        return self.denoiser(layout)(latents, timesteps, embeds[:, 0, 0], layout.sizes[0])
