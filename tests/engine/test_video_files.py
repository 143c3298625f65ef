"""Frames to files (``engine/video_files.py``): MP4s that PyAV decodes back
to their frames at their fps (within H.264's loss, or bit-exact when
lossless), their sound as AAC, odd sizes refused or padded, the first
frame as PNG, an animated WebP preview. Tiny clips: each test well under a
second."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import PIL.Image
import pytest
from video_decode import aligned_correlation, decode_mp4, psnr, smooth_noise

from diffrt.engine import InvalidRequestError
from diffrt.engine.video_files import (
    Waveform,
    clip_files,
    encode_mp4,
    preview_webp,
    spritesheet_jpeg,
    thumbnail_png,
    write_mp4,
)


def test_mp4_decodes_to_its_frames_at_its_fps() -> None:
    own, other = smooth_noise(1), smooth_noise(2)
    decoded = decode_mp4(encode_mp4(own, 16))
    assert (decoded.codec, decoded.pix_fmt) == ("h264", "yuv420p")
    assert decoded.frames.shape == own.shape
    assert decoded.fps == 16
    assert decoded.duration_s == pytest.approx(9 / 16)
    assert decoded.audio is None
    for index, frame in enumerate(decoded.frames):
        mine, theirs = psnr(frame, own[index]), psnr(frame, other[index])
        assert mine >= 20, (index, mine)
        assert mine >= theirs + 3, (index, mine, theirs)


def test_float_frames_are_rounded_as_the_engine_rounds_them() -> None:
    frames = smooth_noise(3, frames=5)
    as_float = frames.astype(np.float32) / 255
    assert decode_mp4(encode_mp4(as_float, 8, lossless=True)).frames.tolist() == frames.tolist()


def test_nan_and_out_of_range_values_are_clamped() -> None:
    frames = np.full((2, 4, 4, 3), 0.5, np.float32)
    frames[0, 0, 0] = [np.nan, 2.0, -1.0]
    frames[1, 0, 0] = [np.inf, -np.inf, 1.0]
    back = decode_mp4(encode_mp4(frames, 8, lossless=True)).frames
    assert back[0, 0, 0].tolist() == [0, 255, 0] and back[1, 0, 0].tolist() == [255, 0, 255]
    assert back[0, 1, 1].tolist() == [128, 128, 128]
    sound = np.sin(np.arange(4800) / 24000 * 2 * np.pi * 300).astype(np.float32)
    noisy = sound.copy()
    noisy[100:110] = np.nan
    decoded = decode_mp4(encode_mp4(frames, 8, audio=Waveform(noisy, 24000))).audio
    assert decoded is not None and np.isfinite(decoded).all()
    assert aligned_correlation(decoded[0], sound)[0] >= 0.99


def test_fractional_fps_is_kept() -> None:
    decoded = decode_mp4(encode_mp4(smooth_noise(4, frames=6), 30000 / 1001))
    assert decoded.fps == Fraction(30000, 1001)
    assert decoded.duration_s == pytest.approx(6 * 1001 / 30000, abs=1e-3)


@pytest.mark.parametrize("size", [(64, 64), (33, 47)])
def test_lossless_round_trips_bit_exact(size: tuple[int, int]) -> None:
    frames = np.random.default_rng(5).integers(0, 256, (5, *size, 3), dtype=np.uint8)
    decoded = decode_mp4(encode_mp4(frames, 12, lossless=True))
    assert decoded.frames.shape == frames.shape
    assert np.array_equal(decoded.frames, frames)
    # per-pixel colour noise is what 4:2:0 loses most: the default is far from exact
    assert psnr(decode_mp4(encode_mp4(frames[:, :32, :46], 12)).frames, frames[:, :32, :46]) < 20


@pytest.mark.parametrize("channels", [1, 2])
def test_waveform_is_muxed_as_aac(channels: int) -> None:
    rate = 24000
    t = np.arange(rate // 2) / rate
    tones = [np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t),
             np.sin(2 * np.pi * 660 * t) * 0.5]
    samples = np.stack(tones[:channels]).astype(np.float32) * 0.6
    frames = smooth_noise(6, frames=8)
    waveform = Waveform(samples[0] if channels == 1 else samples, rate)
    data = encode_mp4(frames, 16, audio=waveform)
    decoded = decode_mp4(data)
    assert decoded.frames.shape == frames.shape
    assert decoded.sample_rate == rate
    assert decoded.audio is not None and decoded.audio.shape[0] == channels
    for channel in range(channels):
        correlation, lag = aligned_correlation(decoded.audio[channel], samples[channel])
        assert correlation >= 0.99, (channel, correlation)
        assert lag < 2048  # AAC's priming, at most two frames of it
    # picture and sound interleaved in the file, not all of one then the other
    kinds = [packet.stream.type for packet in av.open(io.BytesIO(data)).demux() if packet.size]
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("video")


def test_odd_sizes_are_refused_naming_the_side_or_padded() -> None:
    frames = smooth_noise(7, frames=3, height=64, width=64)[:, :63, :]
    with pytest.raises(InvalidRequestError, match="height: is 63: H.264") as caught:
        encode_mp4(frames, 8)
    assert caught.value.field == "height"
    with pytest.raises(InvalidRequestError) as caught:
        encode_mp4(frames[:, :62, :61], 8)
    assert caught.value.field == "width"
    padded = decode_mp4(encode_mp4(frames[:, :, :61], 8, pad_odd=True)).frames
    assert padded.shape == (3, 64, 62, 3)
    assert psnr(padded[:, :63, :61], frames[:, :, :61]) >= 20


def test_bad_inputs_are_refused_by_name() -> None:
    frames = smooth_noise(8, frames=2)
    with pytest.raises(InvalidRequestError, match="sample_rate: is 22000"):
        encode_mp4(frames, 8, audio=Waveform(np.zeros(100), 22000))
    with pytest.raises(ValueError, match="channels"):
        encode_mp4(frames, 8, audio=Waveform(np.zeros((3, 100)), 24000))
    with pytest.raises(InvalidRequestError, match="fps: must be > 0"):
        encode_mp4(frames, 0)
    with pytest.raises(ValueError, match=r"\(frames, height, width, 3\)"):
        encode_mp4(frames[0], 8)
    with pytest.raises(ValueError, match="uint8, or float"):
        encode_mp4(frames.astype(np.int32), 8)


def test_write_mp4_writes_the_file_encode_returns(tmp_path) -> None:
    frames = smooth_noise(9, frames=4)
    path = tmp_path / "clip.mp4"
    write_mp4(str(path), frames, 8, lossless=True)
    assert np.array_equal(decode_mp4(path.read_bytes()).frames, frames)
    assert path.read_bytes()[4:8] == b"ftyp"
    # +faststart: the index (moov) comes before the media (mdat), so a browser plays it early
    data = path.read_bytes()
    assert data.index(b"moov") < data.index(b"mdat")


def test_thumbnail_is_the_first_frame_as_png() -> None:
    frames = smooth_noise(10, frames=3)
    image = PIL.Image.open(io.BytesIO(thumbnail_png(frames)))
    assert image.format == "PNG"
    assert np.array_equal(np.asarray(image), frames[0])


def test_preview_is_an_animated_webp_of_every_frame() -> None:
    frames = smooth_noise(11, frames=5, height=64, width=128)
    image = PIL.Image.open(io.BytesIO(preview_webp(frames, 10, max_side=64)))
    assert image.format == "WEBP"
    assert getattr(image, "n_frames", 1) == 5
    assert image.size == (64, 32)
    image.seek(1)
    image.load()
    assert image.info.get("duration") == 100  # ms a frame: 10 fps
    assert image.info.get("loop") == 0        # loops


def test_spritesheet_puts_evenly_spaced_frames_on_one_grid() -> None:
    frames = np.zeros((9, 32, 48, 3), dtype=np.uint8)
    for index in range(9):
        frames[index] = index * 28                        # each frame its own grey
    sheet = np.asarray(PIL.Image.open(io.BytesIO(spritesheet_jpeg(frames, max_frames=4))))
    assert sheet.shape == (64, 96, 3)                     # 2 x 2 tiles of 48 x 32
    tiles = [sheet[r * 32 + 16, c * 48 + 24] for r in range(2) for c in range(2)]
    expected = [0, 3, 5, 8]                               # first to last, evenly spaced
    for tile, index in zip(tiles, expected, strict=True):
        assert abs(int(tile[0]) - 28 * index) <= 3, (tile, index)
    small = PIL.Image.open(io.BytesIO(spritesheet_jpeg(frames[:3], tile_side=24)))
    assert (small.format, small.size) == ("JPEG", (48, 32))   # 2 columns, 2 rows of 24 x 16


def test_clip_files_are_what_a_video_job_keeps() -> None:
    frames = smooth_noise(12, frames=5)
    files = clip_files(frames, 8)
    assert set(files) == {"video", "thumbnail", "spritesheet"}
    assert decode_mp4(files["video"]).frames.shape == frames.shape
    assert np.array_equal(np.asarray(PIL.Image.open(io.BytesIO(files["thumbnail"]))), frames[0])
    assert PIL.Image.open(io.BytesIO(files["spritesheet"])).format == "JPEG"
