"""Video files from frames: what a video request's output becomes for a
client (an MP4 to download, its first frame as a thumbnail, a small
animated preview), so the server and ``diffrt generate`` write one the same
way.

``write_mp4`` encodes through PyAV (FFmpeg's libraries, bundled in its
wheels): H.264 in ``yuv420p`` at the clip's fps, what every browser and
player decodes, with an optional waveform muxed as AAC (LTX-2's sound).
4:2:0 keeps one chroma sample per 2x2 pixels, so both sides must be even: an
odd one is refused naming it (``InvalidRequestError``), or padded by
repeating the last row/column with ``pad_odd=True`` (the file is then one
pixel larger than the frames). ``lossless=True`` writes RGB H.264 at
``crf=0`` instead (``libx264rgb``): the frames decode back bit-exact (RGB to
YUV alone would round them), at several times the size and with fewer
players able to open it. The ``moov`` atom goes first (``+faststart``) so a
browser plays the file while it downloads; FFmpeg does that by rewriting
the finished file, hence a path and not a stream (``encode_mp4`` writes a
temporary file and returns its bytes).

``thumbnail_png`` (the first frame), ``spritesheet_jpeg`` (frames on one
grid) and ``preview_webp`` (an animated WebP of every frame, for a small
preview) need only Pillow; ``clip_files`` makes what a finished video job
keeps (MP4, thumbnail, spritesheet).
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from diffrt.engine.sampling import InvalidRequestError

#: H.264's default quality here: libx264's own default (crf 23) loses visibly
#: more on fine detail; 18 is the usual "visually lossless" setting
DEFAULT_CRF = 18
#: libx264's speed/size trade-off: "veryfast" encodes a few times faster than
#: "medium" at a slightly larger file (encoding must keep up with the engine)
DEFAULT_PRESET = "veryfast"
#: the sample rates FFmpeg's AAC encoder takes
AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000,
             88200, 96000)
#: samples per AAC frame (what the encoder is fed at a time)
_AAC_FRAME = 1024


def aac_bit_rate(sample_rate: int, channels: int) -> int:
    """The AAC stream's bit rate: near the most an AAC frame holds (6144
    bits a channel per 1024 samples, 6 bits a sample), at most 160 kb/s a
    channel. FFmpeg's default (128 kb/s) cut a tiny LTX-2 clip's noise-like
    sound (16 kHz stereo) to a correlation of 0.98 with what was encoded;
    192 kb/s keeps 0.996."""
    return channels * min(160_000, 6 * sample_rate)


@dataclass(frozen=True)
class Waveform:
    """Sound to mux beside the frames: ``samples`` float in [-1, 1], shaped
    ``(n,)`` (mono) or ``(channels, n)`` with 1 or 2 channels, at
    ``sample_rate`` Hz (one of ``AAC_RATES``)."""

    samples: Any
    sample_rate: int


def as_uint8_frames(frames: Any) -> np.ndarray:
    """``frames`` ((F, H, W, 3): uint8, or float in [0, 1]) as uint8, rounded
    as the engine's images are (``x * 255``, rounded)."""
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or 0 in array.shape:
        raise ValueError(f"frames must be shaped (frames, height, width, 3) with none empty, "
                         f"got {array.shape}")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"frames must be uint8, or float in [0, 1], got {array.dtype}")
    # NaN (a diverged sample) as black rather than whatever a cast makes of it
    pixels = np.nan_to_num(array.astype(np.float32), nan=0.0, posinf=1.0, neginf=0.0)
    return np.round(np.clip(pixels, 0.0, 1.0) * 255).astype(np.uint8)


def even_frames(frames: np.ndarray, *, pad_odd: bool) -> np.ndarray:
    """``frames`` with even height and width (4:2:0 needs them): refused
    naming the odd side, or padded by repeating the last row/column."""
    height, width = frames.shape[1:3]
    odd = [(name, size) for name, size in (("height", height), ("width", width)) if size % 2]
    if not odd:
        return frames
    if not pad_odd:
        name, size = odd[0]
        raise InvalidRequestError(name, f"is {size}: H.264 in yuv420p (the MP4 every player "
                                        "reads) needs an even height and width")
    return np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")


def _channels_first(waveform: Waveform) -> np.ndarray:
    """The waveform as float32 ``(channels, n)``, checked."""
    samples = np.asarray(waveform.samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[None]
    if samples.ndim != 2 or samples.shape[0] not in (1, 2) or samples.shape[1] == 0:
        raise ValueError(f"audio samples must be shaped (n,) or (channels, n) with 1 or 2 "
                         f"channels, got {np.asarray(waveform.samples).shape}")
    if waveform.sample_rate not in AAC_RATES:
        raise InvalidRequestError("sample_rate", f"is {waveform.sample_rate}; AAC takes "
                                                 f"{', '.join(map(str, AAC_RATES))}")
    samples = np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)  # NaN: silence
    return np.ascontiguousarray(np.clip(samples, -1.0, 1.0))


def _frame_rate(fps: float) -> Fraction:
    """``fps`` as the stream's rate (29.97 as 30000/1001)."""
    if not fps > 0 or not np.isfinite(fps):
        raise InvalidRequestError("fps", f"must be > 0, got {fps}")
    return Fraction(fps).limit_denominator(1001)


def write_mp4(path: str, frames: Any, fps: float, *, audio: Waveform | None = None,
              lossless: bool = False, crf: int = DEFAULT_CRF, preset: str = DEFAULT_PRESET,
              pad_odd: bool = False) -> None:
    """Encode ``frames`` ((F, H, W, 3) uint8 or float in [0, 1]) at ``fps`` as
    an MP4 at ``path``: H.264 yuv420p (``crf``: lower is better, 0-51), or
    with ``lossless`` RGB H.264 at crf 0 (bit-exact, any size), and
    ``audio`` as AAC. Writes the file in place: a caller that needs it to
    appear whole writes to a temporary name and renames it."""
    import av

    pixels = as_uint8_frames(frames)
    if not lossless:
        pixels = even_frames(pixels, pad_odd=pad_odd)
    if not 0 <= crf <= 51:
        raise InvalidRequestError("crf", f"must be 0-51, got {crf}")
    rate = _frame_rate(fps)
    sound = None if audio is None else _channels_first(audio)
    with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as container:
        options = {"crf": "0" if lossless else str(crf), "preset": preset}
        video = (container.add_stream("libx264rgb", rate=rate, options=options) if lossless
                 else container.add_stream("libx264", rate=rate, options=options))
        video.height, video.width = pixels.shape[1:3]
        video.pix_fmt = "rgb24" if lossless else "yuv420p"
        layout = "mono" if sound is None or len(sound) == 1 else "stereo"
        sound_stream = None if audio is None else container.add_stream(
            "aac", rate=audio.sample_rate, layout=layout)
        if sound_stream is not None and sound is not None:
            sound_stream.bit_rate = aac_bit_rate(sound_stream.sample_rate, len(sound))
        for index, pixels_of_frame in enumerate(pixels):
            frame = av.VideoFrame.from_ndarray(pixels_of_frame, format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if sound_stream is not None and sound is not None:
            # after the picture: the MP4 muxer interleaves the two by time itself
            for sound_frame in _audio_frames(sound, sound_stream.sample_rate):
                container.mux(sound_stream.encode(sound_frame))
            container.mux(sound_stream.encode(None))


def _audio_frames(sound: np.ndarray, sample_rate: int) -> Iterator[Any]:
    """``sound`` ((channels, n) float32) as the AAC encoder's frames."""
    import av

    layout = "mono" if len(sound) == 1 else "stereo"
    for start in range(0, sound.shape[1], _AAC_FRAME):
        chunk = np.ascontiguousarray(sound[:, start:start + _AAC_FRAME])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = sample_rate
        frame.pts = start
        yield frame


def encode_mp4(frames: Any, fps: float, **options: Any) -> bytes:
    """``write_mp4``'s file as bytes (written to a temporary file, read, removed)."""
    handle, path = tempfile.mkstemp(prefix="diffrt-", suffix=".mp4")
    os.close(handle)
    try:
        write_mp4(path, frames, fps, **options)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def thumbnail_png(frames: Any) -> bytes:
    """The first frame as PNG (OpenAI's ``variant=thumbnail``)."""
    import PIL.Image

    buffer = io.BytesIO()
    PIL.Image.fromarray(as_uint8_frames(frames)[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def preview_webp(frames: Any, fps: float, *, quality: int = 80, max_side: int = 256) -> bytes:
    """Every frame as an animated WebP that loops (lossy at ``quality``),
    scaled down to at most ``max_side`` pixels a side: a small preview an
    ``<img>`` plays."""
    import PIL.Image

    duration_ms = max(1, round(1000 / float(_frame_rate(fps))))
    images = [PIL.Image.fromarray(f) for f in as_uint8_frames(frames)]
    scale = max_side / max(images[0].size)
    if scale < 1:
        size = (max(1, round(images[0].width * scale)), max(1, round(images[0].height * scale)))
        images = [image.resize(size, PIL.Image.Resampling.BILINEAR) for image in images]
    buffer = io.BytesIO()
    images[0].save(buffer, format="WEBP", save_all=True, append_images=images[1:],
                   duration=duration_ms, loop=0, quality=quality)
    return buffer.getvalue()


def spritesheet_jpeg(frames: Any, *, max_frames: int = 16, tile_side: int = 160,
                     quality: int = 85) -> bytes:
    """Up to ``max_frames`` frames, evenly spaced from first to last, on one
    JPEG grid (rows of ``ceil(sqrt(n))``), each scaled to at most
    ``tile_side`` pixels a side: OpenAI's ``variant=spritesheet``, a strip a
    player scrubs over."""
    import PIL.Image

    pixels = as_uint8_frames(frames)
    count = min(max_frames, len(pixels))
    picks = np.round(np.linspace(0, len(pixels) - 1, count)).astype(int)
    height, width = pixels.shape[1:3]
    scale = min(1.0, tile_side / max(height, width))
    tile = (max(1, round(width * scale)), max(1, round(height * scale)))
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    sheet = PIL.Image.new("RGB", (tile[0] * columns, tile[1] * rows))
    for slot, index in enumerate(picks):
        image = PIL.Image.fromarray(pixels[index])
        if image.size != tile:
            image = image.resize(tile, PIL.Image.Resampling.BILINEAR)
        sheet.paste(image, ((slot % columns) * tile[0], (slot // columns) * tile[1]))
    buffer = io.BytesIO()
    sheet.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def clip_files(frames: Any, fps: float, *, audio: Waveform | None = None,
               lossless: bool = False) -> dict[str, bytes]:
    """What a finished video job keeps, by OpenAI's download ``variant``:
    the MP4 (``video``), its first frame (``thumbnail``) and a
    ``spritesheet``. Blocking (encoding takes a while): run it off the
    event loop and the engine's loop."""
    pixels = as_uint8_frames(frames)
    return {"video": encode_mp4(pixels, fps, audio=audio, lossless=lossless),
            "thumbnail": thumbnail_png(pixels), "spritesheet": spritesheet_jpeg(pixels)}


__all__ = ["AAC_RATES", "DEFAULT_CRF", "Waveform", "as_uint8_frames", "clip_files",
           "encode_mp4", "even_frames", "preview_webp", "spritesheet_jpeg", "thumbnail_png",
           "write_mp4"]
