"""2 x 2-packed latent tokens, shared by Flux and Qwen-Image.

Both transformers take image latents packed in 2 x 2 patches, a token each
(channels x 4 values, in diffusers' ``_pack_latents`` order), both use
FlowMatch sigmas ``linspace(1, 1/n, n)`` shifted by the image's token
count, and both condition an edit on its input images' packed tokens after
the output's own (FLUX.1 Kontext, Qwen-Image-Edit). Flux's (row, column)
position ids of those tokens live here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.pipelines.latents import LatentSize, SpatialLatents
from diffrt.engine.pipelines.request_state import EditTokens
from diffrt.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.configuration_utils import FrozenDict


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The resolution-dependent sigma shift (mu), as in diffusers' FluxPipeline."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


class PackedLatents(SpatialLatents):
    """(N, C, h, w) latents as (N, (h/2)(w/2), 4C) tokens."""

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        n, c, h, w = latents.shape
        latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return latents.reshape(n, (h // 2) * (w // 2), c * 4)

    def unpack(self, tokens: torch.Tensor, size: LatentSize) -> torch.Tensor:
        n, _, d = tokens.shape
        h, w = size
        latents = tokens.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return latents.reshape(n, d // 4, h, w)

    def tokens(self, size: LatentSize) -> int:
        """2 x 2 latent patches a token."""
        return (size[0] // 2) * (size[1] // 2)

    def image_ids(self, size: LatentSize, device: torch.device) -> torch.Tensor:
        """Flux's (0, row, column) positions of the packed tokens of latents of ``size``."""
        h, w = (side // 2 for side in size)
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        # float32 whatever the model dtype: bf16 cannot count past 256 exactly
        return ids.reshape(h * w, 3).to(device=device)

    def row_ids(self, size: LatentSize, conds: tuple[tuple[int, int], ...],
                device: torch.device) -> torch.Tensor:
        """A row's token positions: its image's, then (an edit) its input
        images', whose first coordinate is 1 (FluxKontextPipeline's ids)."""
        parts = [self.image_ids(size, device)]
        for cond in conds:
            parts.append(self.image_ids(cond, device))
            parts[-1][:, 0] = 1
        return torch.cat(parts) if conds else parts[0]

    def edit_tokens(self, image_latents: list[torch.Tensor], outputs: int,
                    device: torch.device, dtype: torch.dtype) -> EditTokens:
        """An edit's input images' (1, C, h, w) latents as the packed tokens
        that follow each output row's own, in order."""
        packed = []
        for latents in image_latents:
            latents = torch.cat([latents] * outputs) if outputs > 1 else latents
            packed.append(self.pack(latents.to(device, dtype)))
        return EditTokens(torch.cat(packed, dim=1),
                          tuple((int(x.shape[2]), int(x.shape[3])) for x in image_latents))


class PackedFamily:
    """What a family on packed latents shares (Flux, Qwen-Image): an edit's
    input-image tokens and the shifted sigmas (mixed into its pipeline class,
    before ``FlowMatchPipeline``)."""

    latents: PackedLatents
    noise_scheduler: FlowMatchEulerDiscreteScheduler
    device: torch.device
    dtype: torch.dtype

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """An edit: the input images' packed latents follow the noise's tokens
        in every step, in order (``denoise.row_input``); only the noise's are
        predicted (FLUX.1 Kontext, Qwen-Image-Edit)."""
        state.edit = self.latents.edit_tokens(
            image_latents, state.request.sampling_params.num_outputs_per_prompt, self.device,
            self.dtype)

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        return shifted_sigmas(self.noise_scheduler.config, num_steps,
                              self.latents.tokens(self.latents.size(params)))


def shifted_sigmas(noise_scheduler_config: FrozenDict, num_steps: int, image_tokens: int,
                   max_shift: float = 1.15) -> dict[str, Any]:
    """``set_timesteps`` arguments of Flux and Qwen-Image: sigmas
    ``linspace(1, 1/n, n)``, and ``mu`` from the image's tokens where the
    scheduler shifts dynamically."""
    kwargs: dict[str, Any] = {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps)}
    cfg = noise_scheduler_config
    if cfg.get("use_dynamic_shifting", False):
        kwargs["mu"] = calculate_shift(
            image_tokens,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", max_shift),
        )
    return kwargs


__all__ = ["PackedFamily", "PackedLatents", "calculate_shift", "shifted_sigmas"]
