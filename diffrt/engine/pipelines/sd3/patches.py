"""SD3's token layout: latents cut into ``p`` x ``p`` patches, one token each.

The tokens are in the order diffusers' ``PatchEmbed`` flattens its
convolution's output (row-major over the patch grid), and each token's
values in the order ``SD3Transformer2DModel``'s ``proj_out`` gives them
(patch row, patch column, channel: its unpatchify is
``nhwpqc->nchpwq``). So the transformer's last projection is already a
prediction in this layout (``mixed.forward_rows`` returns it as is), and a
spatial prediction packs to the same numbers. Both functions only move
values: the noise scheduler's elementwise step gives the same numbers in
either layout.
"""

from __future__ import annotations

import torch

from diffrt.engine.pipelines.latents import LatentSize, SpatialLatents


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, h, w) -> (N, (h/p)(w/p), p·p·C)."""
    n, c, h, w = latents.shape
    latents = latents.view(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    return latents.reshape(n, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(tokens: torch.Tensor, size: LatentSize, patch: int) -> torch.Tensor:
    """(N, (h/p)(w/p), p·p·C) -> (N, C, h, w) for latents of ``size`` (h, w)."""
    n, _, d = tokens.shape
    h, w = size
    c = d // (patch * patch)
    tokens = tokens.view(n, h // patch, w // patch, patch, patch, c).permute(0, 5, 1, 3, 2, 4)
    return tokens.reshape(n, c, h, w)


class PatchLatents(SpatialLatents):
    """SD3's ``latents.LatentLayout``: (N, C, h, w) latents as
    (N, (h/p)(w/p), p·p·C) patch tokens."""

    def __init__(self, channels: int, factor: int, patch: int):
        super().__init__(channels, factor)
        self.patch = patch

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return patchify(latents, self.patch)

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        return unpatchify(tokens, size, self.patch)

    def tokens(self, size: LatentSize) -> int:
        return (size[0] // self.patch) * (size[1] // self.patch)
