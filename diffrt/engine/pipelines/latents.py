"""What a latent is, for the denoise loop: a family's ``LatentLayout``.

The loop never looks inside a latent. It asks the family's layout for the
VAE latents' shape (to draw noise), packs them into the transformer's rows
of tokens (``pack``), counts a row's tokens (``tokens``: what padding,
token budgets and step caches measure) and unpacks a prediction back for
the VAE (``unpack``). Every step in between is elementwise over tokens (the
noise scheduler, CFG, inpainting's blend), so it holds for any layout.

Today's layouts are images: a latent ``size`` is (height, width) and a row
is its image's tokens — one token a latent (``SpatialLatents``), a 2 x 2
patch (``packed_latents.PackedLatents``: Flux, Qwen-Image) or a ``p x p``
patch (``sd3.patches.PatchLatents``). A video family's layout keeps the
same contract with ``size`` (frames, height, width): its VAE latents are
(N, C, frames, h, w), ``pack`` flattens frames x patches into one row of
``frames * tokens per frame`` tokens, ``unpack`` restores the frames; an
audio stream beside the video is a second layout whose tokens follow the
video's in the row (the row's ``tokens`` their sum), as an edit's input
image tokens follow its output's today (``RowLayout.conds``). Nothing in
the loop branches on which it is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffrt.engine.sampling import SamplingParams, filled

#: a latent size: (height, width) for an image; (frames, height, width) for a video
LatentSize = tuple[int, ...]


class LatentLayout(Protocol):
    """How a family lays its latents out for its transformer (see the module)."""

    #: the VAE's latent channels and pixels per latent
    channels: int
    factor: int

    def size(self, params: SamplingParams) -> LatentSize:
        """The request's latent size (its pixels over ``factor``; a video's
        latent frames first)."""
        ...

    def shape(self, params: SamplingParams) -> tuple[int, ...]:
        """The VAE latents of the request's outputs: (N, C, *size)."""
        ...

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the transformer's rows of tokens (N, tokens, dim)."""
        ...

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        """Rows of tokens of latents of ``size`` -> VAE latents."""
        ...

    def tokens(self, size: LatentSize) -> int:
        """The transformer's tokens in a row of latents of ``size``."""
        ...


class SpatialLatents:
    """Image latents as the VAE gives them, (N, C, h, w), a token a latent
    position; the base the patch layouts refine (``pack``/``unpack``/``tokens``)."""

    def __init__(self, channels: int, factor: int):
        self.channels = channels
        self.factor = factor

    def size(self, params: SamplingParams) -> LatentSize:
        return filled(params.height) // self.factor, filled(params.width) // self.factor

    def shape(self, params: SamplingParams) -> tuple[int, ...]:
        return (params.num_outputs_per_prompt, self.channels, *self.size(params))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        return tokens

    def tokens(self, size: LatentSize) -> int:
        return size[0] * size[1]

    def noise(self, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """The request's first noise, (N, C, *size) float32 on the CPU, drawn
        from its own generator (the same on every device)."""
        return torch.randn(self.shape(params), generator=generator, dtype=torch.float32)


__all__ = ["LatentLayout", "LatentSize", "SpatialLatents"]
