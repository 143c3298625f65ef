"""Parallel decode of a video VAE (diffusers' ``AutoencoderKLWan``): each
rank decodes a horizontal band of every frame.

The image path's banded decode (``parallel.vae``) on Wan's 3-D decoder,
which decodes a clip one latent frame at a time, each causal convolution
keeping the last frames of its input (diffusers' ``feat_cache``). What
looks beyond a band, and what it gets from the other ranks:

- a causal 3-D convolution (``WanCausalConv3d``) with a spatial kernel
  needs rows above and below: after its cached frames are put in front (each
  rank caches its own band's rows, so the frames line up), the ranks swap
  their edge rows (the halo, as wide as the height padding) and convolve
  without height padding; the edge ranks pad zeros, as the untiled
  convolution does;
- the upsamplers' 2-D convolutions: the image path's ``HaloConv2d``;
- the mid-block's per-frame self-attention (``WanAttentionBlock``): every
  band's keys and values gathered (the queries stay);
- Wan's RMS norm normalises each position over its channels, the
  upsampling (nearest, and Wan 2.2's ``DupUp3D``) moves values within a
  position's block: local, nothing exchanged.

So the clip equals the untiled decode up to the order of float additions.

The converted layers keep their classes' identity: diffusers counts the
decoder's ``WanCausalConv3d`` modules to size its frame cache and tests
``isinstance`` in the decoder's head, so a convolution's or an attention
block's class is swapped for a subclass (same weights, same state-dict
keys) instead of the module being wrapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d
from torch import nn

from diffrt.engine.parallel.collectives import gather_uneven
from diffrt.engine.parallel.vae import Bands, HaloConv2d, exchange_halo


def exchange_frame_rows(x: torch.Tensor, halo: int, group: dist.ProcessGroup | None
                        ) -> torch.Tensor:
    """``x`` (B, C, T, rows, W) with ``halo`` rows of each neighbour's band
    above and below every frame (zeros beyond the clip's edge)."""
    b, c, t, rows, w = x.shape
    out = exchange_halo(x.reshape(b, c * t, rows, w), halo, group)
    return out.view(b, c, t, rows + 2 * halo, w)


class BandCausalConv3d(WanCausalConv3d):
    """``WanCausalConv3d`` over a band of rows (see the module); ``bands`` is
    set when a decoder's convolution is converted."""

    bands: Bands

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        halo = self._padding[2]
        if not self.bands.split or not halo:
            return super().forward(x, cache_x)
        padding = list(self._padding)
        if cache_x is not None and padding[4] > 0:  # the cached frames, as diffusers
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        padding[2] = padding[3] = 0  # the rows come from the neighbours instead
        x = exchange_frame_rows(F.pad(x, padding), halo, self.bands.group)
        return nn.Conv3d.forward(self, x)


class BandAttentionBlock(WanAttentionBlock):
    """``WanAttentionBlock`` (one head, per frame) over a band of rows: this
    band's queries against every band's keys and values."""

    bands: Bands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bands.split:
            return super().forward(x)
        identity = x
        b, c, t, h, w = x.size()
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        qkv = self.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        lengths = self.bands.lengths(h, w)
        k = gather_uneven(k.contiguous(), 2, self.bands.group, lengths)
        v = gather_uneven(v.contiguous(), 2, self.bands.group, lengths)
        x = F.scaled_dot_product_attention(q, k, v)
        x = self.proj(x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity


def convert_video_decoder(decoder: nn.Module, group: dist.ProcessGroup | None) -> Bands:
    """Make an ``AutoencoderKLWan``'s ``decoder`` able to run on bands of
    rows across ``group`` (see the module). Raises ValueError, before
    changing anything, for a layer it cannot split (a strided convolution).
    Returns the switch ``parallel.vae.parallel_decode`` sets."""
    bands = Bands(group)
    swaps: list[tuple[nn.Module, type[nn.Module]]] = []
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in decoder.modules():
        if isinstance(parent, WanCausalConv3d):
            if parent.stride != (1, 1, 1) or parent.dilation != (1, 1, 1):
                raise ValueError(f"parallel VAE decode needs stride-1 convolutions, got {parent}")
            swaps.append((parent, BandCausalConv3d))
        elif isinstance(parent, WanAttentionBlock):
            swaps.append((parent, BandAttentionBlock))
        for name, child in parent.named_children():
            if type(child) is nn.Conv2d and child.kernel_size != (1, 1):
                plan.append((parent, name, HaloConv2d(child, bands)))
    for parent, name, replacement in plan:
        setattr(parent, name, replacement)
    for module, cls in swaps:
        module.__class__ = cls
        setattr(module, "bands", bands)  # noqa: B010 (not a module: no registration)
    return bands


__all__ = ["BandAttentionBlock", "BandCausalConv3d", "convert_video_decoder",
           "exchange_frame_rows"]
