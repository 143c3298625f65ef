"""Output conversion split in two: quantise on the device, convert on the host.

`quantize_images` runs in the worker before the device-to-host copy (uint8 is
a quarter of float32's bytes). `postprocess_output` runs in the engine, off the
busy loop, and builds what the caller asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL.Image import Image

    from diffrt.engine.model_spec import ModelSpec

PostProcess = Callable[[torch.Tensor, str],
                       tuple["list[Image] | list[list[Image]] | None", "torch.Tensor | np.ndarray | None"]]


def quantize_images(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] float (N, C, H, W) -> uint8 (N, H, W, C), on the tensor's
    device; a video's (N, C, F, H, W) -> (N, F, H, W, C)."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    order = (0, 2, 3, 4, 1) if images.dim() == 5 else (0, 2, 3, 1)
    return (images * 255).round().to(torch.uint8).permute(*order).contiguous()


def postprocess_output(host_tensor: torch.Tensor, output_type: str
                       ) -> tuple[list[Image] | list[list[Image]] | None, torch.Tensor | np.ndarray | None]:
    """Return (images, output): PIL images for "pil" (a video: a list of
    frames per output), a uint8 array for "np", the tensor for "pt"/"latent";
    "mp4" (a video) the frames and their uint8 array, which the output
    processor encodes (``encode_clips``)."""
    if output_type == "np":
        return None, _array(host_tensor)
    if output_type in ("pil", "mp4"):  # mp4: the frames, and the array they encode from
        from PIL import Image

        array = _array(host_tensor)
        if array.ndim == 5:  # (N, F, H, W, 3): each output's frames
            clips = [[Image.fromarray(np.ascontiguousarray(f)) for f in clip] for clip in array]
            return clips, array if output_type == "mp4" else None
        return [Image.fromarray(np.ascontiguousarray(a)) for a in array], None
    return None, host_tensor


def _array(host_tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    return host_tensor.numpy() if isinstance(host_tensor, torch.Tensor) else np.asarray(host_tensor)


def encode_clips(clips: torch.Tensor | np.ndarray, fps: float,
                 waveforms: np.ndarray | None = None, sample_rate: int = 0) -> list[bytes]:
    """Each output's frames ((N, F, H, W, 3) uint8) as H.264 MP4 bytes
    (``video_files.encode_mp4``): output_type "mp4"'s ``output``; with
    ``waveforms`` ((N, channels, samples) at ``sample_rate``) each clip's
    sound muxed as AAC."""
    from diffrt.engine.video_files import Waveform, encode_mp4

    return [encode_mp4(clip, fps, audio=None if waveforms is None
                       else Waveform(waveforms[i], sample_rate))
            for i, clip in enumerate(_array(clips))]


def take_sound(value: Any) -> tuple[Any, np.ndarray | None, int | None]:
    """A transferred output -> (its frames' value, its waveform (N, channels,
    samples) float32 or None, its sample rate or None): a family with sound
    sends them by key (``pipelines.sound``), every other output is its frames."""
    if not isinstance(value, dict):
        return value, None, None
    frames, waveform, rate = (value[k] for k in ("frames", "waveform", "sample_rate"))
    return frames, _array(waveform).astype(np.float32, copy=False), int(rate)


#: ModelSpec.postprocess -> its host-side conversion
POSTPROCESSORS: dict[str, PostProcess] = {"images": postprocess_output}


def output_postprocessor(spec: ModelSpec) -> PostProcess:
    """The engine-side conversion of ``spec``'s outputs."""
    return POSTPROCESSORS[spec.postprocess]
