"""Wan's video latents as the transformer's tokens: frames x patches in one row.

``AutoencoderKLWan`` gives (N, C, F, h, w) latents (``F`` = (frames - 1) /
4 + 1, ``h``, ``w`` = pixels / 8); ``WanTransformer3DModel`` cuts them into
``(p_t, p_h, p_w)`` patches, (1, 2, 2) in every released folder, and
flattens the patch grid frame-major (its ``patch_embedding`` then
``flatten(2)``). A row is that sequence: ``F/p_t x h/p_h x w/p_w`` tokens,
each the values of one patch in the order the transformer's ``proj_out``
gives them (``p_t, p_h, p_w, C``), so its prediction unpacks the way its
own forward unpacks it. Packing only moves values: the noise scheduler's
elementwise step gives the same numbers in either layout.
"""

from __future__ import annotations

import torch

from diffrt.engine.pipelines.latents import LatentSize, SpatialLatents
from diffrt.engine.sampling import SamplingParams, filled

#: the text tokens each row attends to beside its video tokens: Wan's prompts
#: padded to 512 (``WanPipeline.__call__``'s ``max_sequence_length``), or the
#: tokenizer's shorter ``model_max_length``; the spec and the pipeline's
#: encoder both read it
TEXT_TOKENS = 512


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(N, C, F, h, w) -> (N, F/pt · h/ph · w/pw, pt·ph·pw·C)."""
    n, c, f, h, w = latents.shape
    pt, ph, pw = patch
    x = latents.view(n, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(n, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)


def unpatchify(tokens: torch.Tensor, size: LatentSize, patch: tuple[int, int, int]) -> torch.Tensor:
    """(N, tokens, pt·ph·pw·C) -> (N, C, F, h, w) for latents of ``size`` (F, h, w)."""
    n, _, d = tokens.shape
    f, h, w = size
    pt, ph, pw = patch
    c = d // (pt * ph * pw)
    x = tokens.view(n, f // pt, h // ph, w // pw, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(n, c, f, h, w)


class VideoLatents(SpatialLatents):
    """Wan's ``latents.LatentLayout`` (see the module): a size is (latent
    frames, height, width)."""

    def __init__(self, channels: int, factor: int, temporal: int, patch: tuple[int, int, int]):
        super().__init__(channels, factor)
        #: frames per latent frame (after the first)
        self.temporal = temporal
        self.patch = patch

    def size(self, params: SamplingParams) -> LatentSize:
        frames = (filled(params.num_frames) - 1) // self.temporal + 1
        return (frames, filled(params.height) // self.factor, filled(params.width) // self.factor)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return patchify(latents, self.patch)

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        return unpatchify(tokens, size, self.patch)

    def tokens(self, size: LatentSize) -> int:
        f, h, w = size
        pt, ph, pw = self.patch
        return (f // pt) * (h // ph) * (w // pw)


__all__ = ["TEXT_TOKENS", "VideoLatents", "patchify", "unpatchify"]
