"""A video's sound beside its frames, on the way out of the shared loop.

The denoise loop hands each request's decoded output around as rows of one
tensor (split per request, batched per size, cloned so each owns its
storage). A family that makes a waveform beside its frames (LTX-2) decodes
both into one float32 row per output — the frames flattened, then the
waveform flattened (``join_sound``) — so all of that holds unchanged, and
parts them again in its ``to_transfer`` (``split_sound``), on the device,
before any copy: the frames go on as uint8, the waveform as float32 with
its sample rate (``sound_transfer``), which the engine's output processor
reads into ``DiffusionOutput.waveform`` / ``sample_rate``
(``engine.postprocess.take_sound``).
"""

from __future__ import annotations

from typing import Any

import torch

from diffrt.engine.sampling import SamplingParams, filled

#: the transfer's keys: frames (uint8), waveform (float32 (N, channels, samples)), its rate
SOUND_KEYS = ("frames", "waveform", "sample_rate")


def join_sound(frames: torch.Tensor, waveform: torch.Tensor) -> torch.Tensor:
    """(N, 3, F, H, W) frames and an (N, C, S) waveform as (N, 3·F·H·W + C·S) float32."""
    return torch.cat([frames.float().flatten(1), waveform.float().flatten(1)], dim=1)


def split_sound(joined: torch.Tensor, params: SamplingParams,
                channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``join_sound``'s rows back to (frames (N, 3, F, H, W), waveform (N, C, S))."""
    n = joined.shape[0]
    shape = (n, 3, filled(params.num_frames), filled(params.height), filled(params.width))
    count = shape[1] * shape[2] * shape[3] * shape[4]
    return joined[:, :count].reshape(shape), joined[:, count:].reshape(n, channels, -1)


def sound_transfer(frames: torch.Tensor, waveform: torch.Tensor, rate: int) -> dict[str, Any]:
    """What crosses to the host: frames, waveform and rate by ``SOUND_KEYS``."""
    return dict(zip(SOUND_KEYS, (frames, waveform.contiguous(), rate), strict=True))


__all__ = ["SOUND_KEYS", "join_sound", "sound_transfer", "split_sound"]
