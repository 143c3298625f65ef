"""LTX-2's sound over OpenAI's videos API and in the engine's own MP4
(issue 48): a tiny-ltx2 job's MP4 from the ``openai`` client carries an AAC
stream whose samples correlate >= 0.99 with the waveform the engine made for
the same seed, channel by channel; the engine's ``output_type="mp4"`` muxes
the same sound; both execution modes give the same waveform."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from engine_helpers import shared_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
from video_decode import aligned_correlation, decode_mp4  # noqa: E402

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams  # noqa: E402
from diffrt.serve import ServeSettings, build_app  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks Sora's API

PROMPT = "a red fox barks"
#: a second of clip: AAC's first frame (the onset of a sound that starts at
#: full level) loses the most, so a clip of 9 frames (0.4 s) correlates
#: 0.99 at best; 25 frames 0.996
FRAMES = 25


def make_engine(step: bool) -> DiffusionEngine:
    return DiffusionEngine.make_engine(EngineConfig(
        model="tiny-ltx2", executor_backend="inproc", warmup=False, step_execution=step,
        max_num_seqs=2, max_request_seconds=3600))


@pytest.fixture(scope="module")
def engine():
    with shared_engine(make_engine(True)) as shared:
        yield shared


def engine_clip(engine: DiffusionEngine, seed: int, output_type: str = "np") -> Any:
    out = engine.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
        seed=seed, num_frames=FRAMES, output_type=output_type)))
    assert out.ok, out.error
    return out


def assert_sound_of(decoded: Any, waveform: np.ndarray, rate: int) -> None:
    assert decoded.audio is not None and decoded.sample_rate == rate
    assert decoded.audio.shape[0] == waveform.shape[0] == 2  # stereo
    for channel in range(2):
        correlation, _ = aligned_correlation(decoded.audio[channel], waveform[channel])
        assert correlation >= 0.99, (channel, correlation)


def test_a_video_job_mp4_carries_the_engines_sound(engine, tmp_path):
    app = build_app(settings=ServeSettings(video_dir=str(tmp_path)), engine=engine)

    async def scenario() -> bytes:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)
            job = await client.videos.create_and_poll(
                prompt=PROMPT, size="32x32", poll_interval_ms=50,
                extra_body={"seed": 5, "num_frames": FRAMES})
            assert job.status == "completed", job.error
            return (await client.videos.download_content(job.id)).read()

    decoded = decode_mp4(asyncio.run(scenario()))
    want = engine_clip(engine, 5)
    assert want.sample_rate == 16000 and want.waveform.shape[:2] == (1, 2)
    assert decoded.frames.shape == want.output[0].shape
    assert_sound_of(decoded, want.waveform[0], want.sample_rate)
    # another seed's sound is another sound
    other = engine_clip(engine, 6).waveform[0]
    assert aligned_correlation(decoded.audio[0], other[0])[0] < 0.9


def test_engine_mp4_muxes_the_sound_and_both_modes_make_the_same(engine):
    mp4 = engine_clip(engine, 7, "mp4")
    stepped = engine_clip(engine, 7)
    assert mp4.waveform is not None
    assert_sound_of(decode_mp4(mp4.output[0]), stepped.waveform[0], 16000)
    with make_engine(False) as whole:  # request-batch execution
        batched = engine_clip(whole, 7)
    assert np.abs(batched.waveform - stepped.waveform).max() <= 1e-5
    assert np.abs(batched.output.astype(int) - stepped.output.astype(int)).max() <= 1
