"""Parallel VAE decode: each rank decodes a horizontal band of the image.

The latent rows are split into one band per rank and every rank runs the
whole decoder on its band. Three kinds of layer look beyond a band, and each
gets what it needs from the other ranks, so the result is the untiled decode
(up to float rounding), not an approximation of it:

- a 3×3 convolution needs one row above and below: before each one, the
  ranks swap their edge rows with their neighbours (the *halo*, as wide as
  the convolution's padding) and convolve without vertical padding; the
  top and bottom ranks pad with zeros as the untiled convolution does;
- a group norm needs the statistics of the whole image: each rank's
  per-group mean, variance and count are all-gathered and combined exactly
  (float32);
- the mid-block's self-attention needs every key and value: they are
  all-gathered (the queries stay).

Upsampling (nearest) and the pointwise layers are local. Blended tiles, the
other way to split a decode (diffusers' ``enable_tiling``), differ from the
untiled image because each tile normalises with its own statistics; here
nothing differs but the order of float additions.

```
2 ranks, latent 8 rows -> image 64 rows:
  rank 0: latent rows 0..3  -> image rows 0..31    (+1 halo row from rank 1 per conv)
  rank 1: latent rows 4..7  -> image rows 32..63   (+1 halo row from rank 0 per conv)
  then the bands are all-gathered: every rank holds the image
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diffrt.engine.parallel.collectives import gather_uneven, share, shares

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, AutoencoderKLWan
    from diffusers.models.attention_processor import Attention


class Bands:
    """The group the converted decoder splits over, and whether the current
    decode is split (an image with fewer latent rows than ranks is decoded
    whole on every rank, by the same layers running unsplit)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.split = False
        #: every rank's latent rows in the current decode
        self.latent_rows: list[int] = []

    def lengths(self, rows_here: int, per_row: int) -> list[int]:
        """Every rank's share of a tensor whose band here has ``rows_here``
        rows of ``per_row`` items, at whatever resolution the decoder is."""
        scale = rows_here // self.latent_rows[dist.get_rank(self.group)]
        return [rows * scale * per_row for rows in self.latent_rows]


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    # None is the default group, where a group rank is the global rank
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange_halo(x: torch.Tensor, halo: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` (B, C, rows, W) with ``halo`` rows of each neighbour's band added
    above and below (zeros beyond the image's edge)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, c, _, w = x.shape
    above = x.new_zeros(b, c, halo, w)
    below = x.new_zeros(b, c, halo, w)
    ops = []
    if rank > 0:
        ops += [dist.P2POp(dist.isend, x[:, :, :halo].contiguous(), _peer(group, rank - 1), group),
                dist.P2POp(dist.irecv, above, _peer(group, rank - 1), group)]
    if rank < world - 1:
        ops += [dist.P2POp(dist.isend, x[:, :, -halo:].contiguous(), _peer(group, rank + 1), group),
                dist.P2POp(dist.irecv, below, _peer(group, rank + 1), group)]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([above, x, below], dim=2)


class HaloConv2d(nn.Module):
    """``conv`` over a band of rows: neighbours' halo rows instead of vertical
    zero padding (same weights, same numbers as the untiled convolution)."""

    def __init__(self, conv: nn.Conv2d, bands: Bands) -> None:
        super().__init__()
        kh, _ = conv.kernel_size
        padding = conv.padding if isinstance(conv.padding, tuple) else None  # not "same"
        if (conv.stride != (1, 1) or conv.dilation != (1, 1) or conv.padding_mode != "zeros"
                or padding is None or kh != 2 * padding[0] + 1):
            raise ValueError(f"parallel VAE decode needs stride-1 'same' convolutions, got {conv}")
        ph, pw = padding
        self.conv, self.bands, self.halo, self.pad_w = conv, bands, ph, pw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bands.split:
            return self.conv(x)
        if self.halo:
            x = exchange_halo(x, self.halo, self.bands.group)
        conv = self.conv
        return F.conv2d(x, conv.weight, conv.bias, 1, (0, self.pad_w), 1, conv.groups)


class BandGroupNorm(nn.Module):
    """``norm`` with the statistics of all ranks' bands: each rank's per-group
    mean and variance (float32) and element count are all-gathered and
    combined exactly (Chan et al.'s pairwise formula), one collective per
    norm; then one multiply-add per element."""

    def __init__(self, norm: nn.GroupNorm, bands: Bands) -> None:
        super().__init__()
        self.norm, self.bands = norm, bands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if not self.bands.split:
            return norm(x)
        b, c = x.shape[:2]
        groups = norm.num_groups
        # torch's own group-norm kernel (one fused, vectorised pass; a reduction
        # over (b, groups, -1) is several times slower) normalises with this
        # band's statistics; the whole image's differ by a per-group affine
        # map, applied in place to that output
        local, mean, rstd = torch.native_group_norm(x.float().contiguous(), None, None, b, c,
                                                    x[0, 0].numel(), groups, norm.eps)
        mean, rstd = mean.view(b, groups), rstd.view(b, groups)
        var = rstd ** -2 - norm.eps
        count = torch.full_like(mean, x[0].numel() / groups)
        mine = torch.stack([mean, var, count]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.bands.group))]
        dist.all_gather(parts, mine, group=self.bands.group)
        means, variances, counts = torch.stack(parts).unbind(1)  # each (ranks, b, groups)
        total = counts.sum(0)
        whole_mean = (means * counts).sum(0) / total
        whole_var = ((variances + (means - whole_mean) ** 2) * counts).sum(0) / total
        whole_rstd = torch.rsqrt(whole_var + norm.eps)
        # (x - m) r = local * (r / rstd) + (mean - m) r, per group, then the affine
        scale = (whole_rstd / rstd).repeat_interleave(c // groups, dim=1)  # (b, c)
        shift = ((mean - whole_mean) * whole_rstd).repeat_interleave(c // groups, dim=1)
        if norm.affine:
            weight = norm.weight.float()
            shift = shift * weight + norm.bias.float()
            scale = scale * weight
        shape = (b, c) + (1,) * (x.dim() - 2)
        return local.mul_(scale.view(shape)).add_(shift.view(shape)).to(x.dtype)


class BandAttnProcessor:
    """diffusers' ``AttnProcessor2_0`` for the VAE's spatial self-attention
    over bands: this rank's queries against every rank's keys and values."""

    def __init__(self, bands: Bands) -> None:
        self.bands = bands

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 temb: torch.Tensor | None = None, *args: object, **kwargs: object) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or attn.spatial_norm:
            raise ValueError("parallel VAE decode handles plain spatial self-attention only")
        residual = hidden_states
        b, c, h, w = hidden_states.shape
        x = hidden_states.view(b, c, h * w).transpose(1, 2)
        if attn.group_norm is not None:  # a BandGroupNorm once the decoder is converted
            x = attn.group_norm(x.transpose(1, 2)).transpose(1, 2)
        query, key, value = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        if self.bands.split:
            lengths = self.bands.lengths(h, w)
            key = gather_uneven(key, 1, self.bands.group, lengths)
            value = gather_uneven(value, 1, self.bands.group, lengths)
        head_dim = key.shape[-1] // attn.heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, attn.heads, head_dim).transpose(1, 2)

        query, key = heads(query), heads(key)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        out = F.scaled_dot_product_attention(query, key, heads(value))
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def convert_decoder(decoder: nn.Module, group: dist.ProcessGroup | None) -> Bands:
    """Make ``decoder`` (an AutoencoderKL's) able to run on bands of rows
    across ``group``: convolutions exchange halos, group norms share
    statistics, attention gathers keys and values. Raises ValueError, before
    changing anything, for a layer it cannot split (a strided or 3-D
    convolution). Returns the switch ``parallel_decode`` sets."""
    from diffusers.models.attention_processor import Attention

    bands = Bands(group)
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in decoder.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                plan.append((parent, name, HaloConv2d(child, bands)))
            elif isinstance(child, nn.GroupNorm):
                plan.append((parent, name, BandGroupNorm(child, bands)))
            elif isinstance(child, (nn.Conv1d, nn.Conv3d, nn.BatchNorm2d)):
                raise ValueError(f"parallel VAE decode cannot split {type(child).__name__} layers")
    for parent, name, replacement in plan:
        setattr(parent, name, replacement)
    for module in decoder.modules():
        if isinstance(module, Attention):
            # diffusers annotates the union of its own processors; any callable
            # with their signature is one
            module.set_processor(BandAttnProcessor(bands))
    return bands


def parallel_decode(vae: AutoencoderKL | AutoencoderKLWan, latents: torch.Tensor,
                    bands: Bands) -> torch.Tensor:
    """``vae.decode(latents)`` by a decoder converted by ``convert_decoder``
    (or, for a video VAE, ``video_vae.convert_video_decoder``): this rank's
    band of rows (the second-to-last dimension: an image's (B, C, h, w), each
    frame's of a clip's (B, C, F, h, w)) decoded, the bands all-gathered. A
    picture with fewer latent rows than ranks is decoded whole on every rank."""
    group = bands.group
    dim = latents.dim() - 2
    rows, world = latents.shape[dim], dist.get_world_size(group)
    if rows < world:
        return vae.decode(latents, return_dict=False)[0]
    bands.split, bands.latent_rows = True, shares(rows, world)
    try:
        here = (slice(None),) * dim + (share(rows, group),)
        image = vae.decode(latents[here], return_dict=False)[0]
        return gather_uneven(image, dim, group, bands.lengths(image.shape[dim], 1))
    finally:
        bands.split = False


__all__ = ["BandAttnProcessor", "BandGroupNorm", "Bands", "HaloConv2d", "convert_decoder",
           "exchange_halo", "parallel_decode"]
