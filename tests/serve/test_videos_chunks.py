"""Issue 48's streamed chunks: ``/v1/videos/{id}/events`` on tiny-helios
(in-process app around one in-process step engine, over HTTP through
httpx's ASGI transport) sends a ``video.chunk`` event per finished chunk,
each a base64 animated WebP of that chunk's frames, before ``video.completed``,
each closer to its own chunk of the engine's frames than to another; a
watcher that comes after the run still gets them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import PIL.Image
import pytest
from engine_helpers import shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.serve import ServeSettings, build_app

pytest.importorskip("diffusers")

PROMPT, SEED, WINDOW = "a red fox runs", 3, 5  # tiny-helios: 5 frames a chunk


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model="tiny-helios", executor_backend="inproc", warmup=False,
                          step_execution=True, max_num_seqs=2, max_request_seconds=3600)
    with shared_engine(DiffusionEngine.make_engine(config)) as shared:
        yield shared


def events_of(stream: str) -> list[tuple[str, dict]]:
    return [(block.split("\n")[0][len("event: "):], json.loads(block.split("\n")[1][6:]))
            for block in stream.strip().split("\n\n")]


def webp_frames(data: str) -> np.ndarray:
    image = PIL.Image.open(io.BytesIO(base64.b64decode(data)))
    frames = []
    for k in range(image.n_frames):
        image.seek(k)
        frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames).astype(np.float64)


def test_each_finished_chunk_is_an_event_before_completed(engine, tmp_path: Path):
    app = build_app(settings=ServeSettings(video_dir=str(tmp_path)), engine=engine)

    async def scenario() -> tuple[str, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as http:
            job = (await http.post("/v1/videos", json={
                "prompt": PROMPT, "size": "32x32", "num_frames": 13, "seed": SEED})).json()
            live = (await http.get(f"/v1/videos/{job['id']}/events")).text
            late = (await http.get(f"/v1/videos/{job['id']}/events")).text
            return live, late

    live, late = asyncio.run(scenario())
    events = events_of(live)
    names = [name for name, _ in events]
    assert names[-1] == "video.completed" and names.count("video.chunk") == 2
    assert names.index("video.chunk") < names.index("video.completed")
    chunks = [data for name, data in events if name == "video.chunk"]
    clip = engine.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
        seed=SEED, num_frames=13, output_type="np"))).output[0].astype(np.float64)
    for k, chunk in enumerate(chunks):
        assert (chunk["chunk_index"], chunk["first_frame"], chunk["frames"]) == (k, k * WINDOW,
                                                                                 WINDOW)
        assert chunk["media_type"] == "image/webp" and chunk["total_steps"] == 6
        frames = webp_frames(chunk["b64_webp"])
        assert frames.shape == (WINDOW, 32, 32, 3)
        own = np.abs(frames - clip[k * WINDOW:(k + 1) * WINDOW]).mean()
        other = np.abs(frames - clip[(1 - k) * WINDOW:(2 - k) * WINDOW]).mean()
        assert own < other  # the chunk's own frames, not another's
    assert [n for n, _ in events_of(late)].count("video.chunk") == 2


def test_seconds_whole_chunks_do_not_give_are_a_400_naming_them(engine, tmp_path: Path):
    app = build_app(settings=ServeSettings(video_dir=str(tmp_path)), engine=engine)

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post("/v1/videos", json={"prompt": PROMPT, "seconds": "0.25"})

    answer = asyncio.run(scenario())
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "seconds"
    assert "whole chunks" in error["message"] and "0.5" in error["message"]
