"""The worker side of ``diffrt env --check``'s output-bubble measurement.

A Flux transformer with the real model's widths (24 heads of 128, T5 width
4096) and random weights, a few blocks deep, denoising 1024x1024 latents: a
forward long enough (``steps`` transformer calls, calibrated to >= 100 ms)
that the output copy is a bubble worth measuring, without a 24 GB download.
Each request's output is image-sized float32 (3 x H x W, what a decoded
picture is before the uint8 transfer form), made from the final latents.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from diffrt.runtime import RunnerProtocol, RunnerResult

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: (heads, head dim, text width, pooled width, rope axes) per width preset
WIDTHS = {
    "flux": (24, 128, 4096, 768, (16, 56, 56)),
    "tiny": (2, 16, 32, 32, (4, 6, 6)),  # the CPU test of the check itself
}
TEXT_TOKENS = 512  # Flux-dev's T5 sequence length


class CheckSettings(msgspec.Struct):
    size: int = 1024
    widths: str = "flux"
    double_blocks: int = 2
    single_blocks: int = 4
    dtype: str = "auto"  # bfloat16 on a device, float32 on CPU


class Calibrate(msgspec.Struct, tag="calibrate"):
    """Time one transformer call (median of a few, device synchronised)."""


class Forward(msgspec.Struct, tag="forward"):
    id: str
    steps: int
    seed: int
    drop: bool = False


class Timed(msgspec.Struct, tag="timed"):
    seconds: float = 0.0


CHECK_PROTOCOL = RunnerProtocol(settings=CheckSettings, requests=Calibrate | Forward,
                                replies=Timed)


def image_ids(size: int) -> torch.Tensor:
    """Flux's (0, row, column) ids of the packed 2x2 latent patches."""
    side = size // 16
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return ids.reshape(-1, 3)


class FluxWidthRunner:
    """Lives in the worker; answers Calibrate and Forward."""

    protocol = CHECK_PROTOCOL

    def __init__(self, settings: CheckSettings, *, rank: int, world_size: int, platform: Platform):
        from diffusers import FluxTransformer2DModel

        self.platform = platform
        self.device = platform.torch_device(None if platform.device_type == "cpu" else rank)
        dtype = settings.dtype
        if dtype == "auto":
            dtype = "float32" if platform.device_type == "cpu" else "bfloat16"
        self.dtype = getattr(torch, dtype)
        self.size = settings.size
        heads, head_dim, text_dim, pooled_dim, axes = WIDTHS[settings.widths]
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        # random weights made on the device in their dtype: no host copy, no cast
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                # mypy sees no inherited methods on diffusers' mixin classes (eval)
                self.model = FluxTransformer2DModel(
                    patch_size=1, in_channels=64, num_layers=settings.double_blocks,
                    num_single_layers=settings.single_blocks, attention_head_dim=head_dim,
                    num_attention_heads=heads, joint_attention_dim=text_dim,
                    pooled_projection_dim=pooled_dim, guidance_embeds=False,
                    axes_dims_rope=axes).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        tokens = (settings.size // 16) ** 2
        gen = torch.Generator().manual_seed(1)
        self.text = torch.randn(1, TEXT_TOKENS, text_dim, generator=gen).to(self.device, self.dtype)
        self.pooled = torch.randn(1, pooled_dim, generator=gen).to(self.device, self.dtype)
        self.img_ids = image_ids(settings.size).to(self.device)
        self.txt_ids = torch.zeros(TEXT_TOKENS, 3, device=self.device)
        self.tokens = tokens

    def close(self) -> None:
        self.model = None

    def handle(self, request: Any) -> Any:
        match request:
            case Calibrate():
                return self.calibrate()
            case Forward():
                return self.forward(request)
            case _:
                raise TypeError(f"FluxWidthRunner cannot handle {type(request).__name__}")

    @torch.inference_mode()
    def _step(self, latents: torch.Tensor, t: float) -> torch.Tensor:
        timestep = torch.full((1,), t, device=self.device, dtype=self.dtype)
        velocity = self.model(hidden_states=latents, encoder_hidden_states=self.text,
                              pooled_projections=self.pooled, timestep=timestep,
                              img_ids=self.img_ids, txt_ids=self.txt_ids, return_dict=False)[0]
        return latents - velocity / 50

    def _latents(self, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(1, self.tokens, 64, generator=gen).to(self.device, self.dtype)

    def calibrate(self) -> RunnerResult:
        latents = self._latents(0)
        times = []
        for _ in range(4):
            self.platform.synchronize()
            start = time.perf_counter()
            self._step(latents, 1.0)
            self.platform.synchronize()
            times.append(time.perf_counter() - start)
        return RunnerResult(reply=Timed(sorted(times[1:])[1]))

    @torch.inference_mode()
    def forward(self, p: Forward) -> RunnerResult:
        start = time.perf_counter()
        latents = self._latents(p.seed)
        for i in range(p.steps):
            latents = self._step(latents, 1.0 - i / max(p.steps, 1))
        side = self.size // 16
        # unpack the 2x2 patches: (1, 16, H/8, W/8), three channels blown up to H x W
        grid = latents.reshape(1, side, side, 16, 2, 2).permute(0, 3, 1, 4, 2, 5)
        grid = grid.reshape(1, 16, side * 2, side * 2)[:, :3].float()
        image = torch.nn.functional.interpolate(grid, scale_factor=8)[0].contiguous()
        if p.drop:  # nothing to copy: the device's time still counts
            self.platform.synchronize()
            return RunnerResult(reply=Timed(time.perf_counter() - start))
        return RunnerResult(reply=Timed(time.perf_counter() - start), outputs={p.id: image})
