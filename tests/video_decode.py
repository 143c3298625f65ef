"""Decoding for the video tests (PyAV), and the measures they compare with:
the frames and sound of an MP4, PSNR, and a waveform's alignment with the
one that was encoded (AAC starts with a priming delay of its own)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass
class Decoded:
    frames: np.ndarray            # (F, H, W, 3) uint8
    fps: Fraction                 # the video stream's average rate
    duration_s: float             # the video stream's duration
    codec: str
    pix_fmt: str
    audio: np.ndarray | None      # (channels, n) float32
    sample_rate: int | None


def decode_mp4(data: bytes) -> Decoded:
    import av

    with av.open(io.BytesIO(data)) as container:
        video = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video)])
        duration = float(video.duration * video.time_base)
        fps, codec = video.average_rate, video.codec_context.name
        pix_fmt = video.codec_context.pix_fmt
    audio, rate = None, None
    with av.open(io.BytesIO(data)) as container:
        if container.streams.audio:
            stream = container.streams.audio[0]
            rate = stream.sample_rate
            audio = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    return Decoded(frames, fps, duration, codec, pix_fmt, audio, rate)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def aligned_correlation(decoded: np.ndarray, original: np.ndarray) -> tuple[float, int]:
    """The correlation of ``original`` with the stretch of ``decoded`` it
    lines up with (the lag found by cross-correlation), and that lag."""
    n = len(decoded) + len(original)
    cross = np.fft.irfft(np.fft.rfft(decoded, n) * np.conj(np.fft.rfft(original, n)), n)
    lag = int(np.argmax(cross[:len(decoded)]))
    stretch = decoded[lag:lag + len(original)]
    return float(np.corrcoef(stretch, original[:len(stretch)])[0, 1]), lag


def smooth_noise(seed: int, frames: int = 9, height: int = 64, width: int = 64) -> np.ndarray:
    """Noise-like frames as a random-weight model's decoder makes them: a
    random field at 1/8 resolution, upsampled, with fine noise on top
    (per-pixel colour noise alone would not survive 4:2:0 chroma: ~13 dB)."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (frames, height // 8 + 1, width // 8 + 1, 3))
    ys, xs = np.linspace(0, height // 8, height), np.linspace(0, width // 8, width)
    y0, x0 = np.floor(ys).astype(int).clip(max=height // 8 - 1), \
        np.floor(xs).astype(int).clip(max=width // 8 - 1)
    fy, fx = (ys - y0)[None, :, None, None], (xs - x0)[None, None, :, None]
    top = coarse[:, y0][:, :, x0] * (1 - fx) + coarse[:, y0][:, :, x0 + 1] * fx
    bottom = coarse[:, y0 + 1][:, :, x0] * (1 - fx) + coarse[:, y0 + 1][:, :, x0 + 1] * fx
    field = top * (1 - fy) + bottom * fy + rng.normal(0, 6, (frames, height, width, 3))
    return np.clip(np.round(field), 0, 255).astype(np.uint8)
