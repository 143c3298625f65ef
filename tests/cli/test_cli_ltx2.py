"""``diffrt generate`` with LTX-2 (tiny-ltx2): an .mp4 path gets the clip
with its sound as an AAC stream, and the line says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
from video_decode import decode_mp4  # noqa: E402

pytest.importorskip("diffusers")


def test_generate_writes_an_ltx2_clip_with_its_sound(cli, tmp_path):
    proc = cli("generate", "--model", "tiny-ltx2", "--prompt", "a red fox barks",
               "--num-frames", "9", "--steps", "2", "--seed", "3", "--executor-backend",
               "inproc", "-o", "clip.mp4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "H.264 + AAC stereo sound at 16000 Hz, 9 frames of 32x32" in proc.stdout, proc.stdout
    decoded = decode_mp4((tmp_path / "clip.mp4").read_bytes())
    assert decoded.frames.shape == (9, 32, 32, 3)
    assert decoded.sample_rate == 16000 and decoded.audio is not None
    assert decoded.audio.shape[0] == 2 and decoded.audio.std() > 0.01
