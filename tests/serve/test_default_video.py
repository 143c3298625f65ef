"""The default model's server serves videos too: beside diffrt-shapes (the
images) it runs diffrt-motion on an engine of its own, which ``/v1/videos``
uses (``ServeSettings.default_video``). Through the in-process app with its
lifespan (both engines started, warmed and drained by it, in-process
executors): both models listed, both engines in /health and /ready, a clip
from the default video model and a picture from the default model in the same
session, each engine's metrics labelled with its model; ``--no-default-video``
and another model serve one engine; a video model that cannot be loaded, or
a default video folder another server holds, leave the images served."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from waiting import HANG_GUARD_S

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
from video_decode import decode_mp4  # noqa: E402

from diffrt.demo import motion  # noqa: E402
from diffrt.engine import EngineConfig  # noqa: E402
from diffrt.serve import ServeSettings, build_app  # noqa: E402

pytest.importorskip("diffusers")

#: a held-out combination (never trained on) the model draws right at seed 0
CLIP = next(c for c in motion.EVALUATION if c.direction == "left to right")


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(executor_backend="inproc", step_execution=True, **kw)


def serve(app: Any, scenario: Any) -> Any:
    """``scenario(http)`` inside the app's lifespan (its engines start at the
    beginning and are drained and closed at the end), once /ready is 200."""
    async def main() -> Any:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as http:
                # both engines load and warm up (seconds; minutes on a busy machine)
                give_up = asyncio.get_running_loop().time() + HANG_GUARD_S
                while (await http.get("/ready")).status_code != 200:
                    assert asyncio.get_running_loop().time() < give_up, "never ready"
                    await asyncio.sleep(0.05)
                return await scenario(http)

    return asyncio.run(main())


async def finished(http: httpx.AsyncClient, video_id: str) -> dict:
    give_up = asyncio.get_running_loop().time() + HANG_GUARD_S
    while asyncio.get_running_loop().time() < give_up:
        job = (await http.get(f"/v1/videos/{video_id}")).json()
        if job["status"] in ("completed", "failed"):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"{video_id} never finished")


@pytest.mark.timeout(HANG_GUARD_S)  # two engines start: minutes on a busy machine
def test_the_default_server_makes_pictures_and_clips(tmp_path):
    ready: list[str] = []
    app = build_app(config(), ServeSettings(video_dir=str(tmp_path)),
                    on_ready=lambda: ready.append("ready"))
    clients = app.state.clients
    assert [c.model_name for c in clients] == ["diffrt-shapes", "diffrt-motion"]
    assert app.state.video_client is clients[1]

    async def scenario(http: httpx.AsyncClient) -> dict[str, Any]:
        got: dict[str, Any] = {}
        got["models"] = (await http.get("/v1/models")).json()
        got["health"] = (await http.get("/health")).json()
        got["ready"] = (await http.get("/ready")).json()
        job = (await http.post("/v1/videos", json={"prompt": CLIP.prompt, "seed": 0})).json()
        got["job"] = await finished(http, job["id"])
        got["mp4"] = (await http.get(f"/v1/videos/{job['id']}/content")).content
        got["image"] = await http.post("/v1/images/generations", json={
            "prompt": "a red circle on a yellow background in the top left", "seed": 0})
        got["wrong_model"] = await http.post("/v1/videos", json={
            "prompt": CLIP.prompt, "model": "diffrt-shapes"})
        got["metrics"] = (await http.get("/metrics")).text
        return got

    got = serve(app, scenario)
    assert ready == ["ready"]  # once, when both engines were warm
    models = got["models"]["data"]
    assert [m["id"] for m in models] == ["diffrt-shapes", "diffrt-motion"]
    motion_defaults = models[1]["diffrt"]["defaults"]
    assert (motion_defaults["num_frames"], motion_defaults["height"], motion_defaults["fps"]) == (
        9, 64, 8)
    for body in (got["health"], got["ready"]):
        assert [e["model"] for e in body["engines"]] == ["diffrt-shapes", "diffrt-motion"]
        assert {e["state"] for e in body["engines"]} == {"ready"}
    assert got["health"]["status"] == "ok" and got["ready"]["status"] == "ready"

    job = got["job"]
    assert job["status"] == "completed", job
    assert job["model"] == "diffrt-motion" and job["size"] == "64x64"
    clip = decode_mp4(got["mp4"])
    assert clip.frames.shape == (9, 64, 64, 3) and clip.fps == 8
    reading = motion.classify(clip.frames)
    assert reading.background == CLIP.background, reading

    assert got["image"].status_code == 200, got["image"].text
    # the images' model is not the videos': named, it is refused as OpenAI refuses
    assert got["wrong_model"].status_code == 404
    assert "diffrt-motion" in got["wrong_model"].json()["error"]["message"]
    # each engine's series carries its model, apart from the step-cost fit's own label
    lines = got["metrics"].splitlines()
    for name in ("diffrt-shapes", "diffrt-motion"):
        assert any(ln.startswith("diffrt_requests_total{") and f'engine="{name}"' in ln
                   for ln in lines), name
        assert any(ln.startswith("diffrt_step_cost_coefficient{") and f'engine="{name}"' in ln
                   and 'model="online"' in ln for ln in lines), name
    assert all(c.state == "stopped" for c in clients)  # drained and closed by the lifespan


@pytest.mark.parametrize("case", ["no-default-video", "another-model"])
def test_one_engine_when_the_default_video_is_off_or_the_model_is_another(case, tmp_path):
    if case == "no-default-video":
        app = build_app(config(), ServeSettings(video_dir=str(tmp_path), default_video=False))
    else:
        app = build_app(config(model="tiny-flux"), ServeSettings(video_dir=str(tmp_path)))
    assert len(app.state.clients) == 1 and app.state.video_client is app.state.client
    assert app.state.videos is None  # an image model alone: no job store

    async def scenario(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/videos", json={"prompt": CLIP.prompt})

    refused = serve(app, scenario)
    assert refused.status_code == 404
    assert "makes images, not video" in refused.json()["error"]["message"]


def test_a_video_model_that_cannot_load_leaves_the_images_served(tmp_path, monkeypatch, caplog):
    import diffrt.serve.app as app_module

    monkeypatch.setattr(app_module, "DEFAULT_VIDEO_MODEL", "no-such-video-model")
    app = build_app(config(), ServeSettings(video_dir=str(tmp_path)))
    assert len(app.state.clients) == 1 and app.state.videos is None
    assert "no-such-video-model could not start" in caplog.text
    assert "the images are served without it" in caplog.text

    async def scenario(http: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        return (await http.post("/v1/videos", json={"prompt": CLIP.prompt}),
                await http.post("/v1/images/generations", json={"prompt": "a red circle"}))

    video, image = serve(app, scenario)
    assert video.status_code == 404 and "server's log says why" in video.json()["error"]["message"]
    assert image.status_code == 200


def test_image_settings_the_video_engine_does_not_take_stay_the_images(tmp_path):
    """Layer-wise offload with its prefetch depth for the image model: the
    video engine runs whole, without the prefetch its copy would refuse."""
    app = build_app(config(offload="layerwise", offload_prefetch=3),
                    ServeSettings(video_dir=str(tmp_path)))
    first, second = app.state.clients
    assert (first.config.offload, first.config.offload_prefetch) == ("layerwise", 3)
    assert second.config.offload == "none" and second.config.model == "diffrt-motion"
    app.state.videos.close()


def test_a_second_default_server_without_a_video_dir_serves_images_only(tmp_path, monkeypatch,
                                                                        caplog):
    """The default video folder is locked by the server that opened it: a
    second default server on the host (no --video-dir) starts, images only."""
    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(tmp_path))
    first = build_app(config(), ServeSettings())
    try:
        assert len(first.state.clients) == 2
        second = build_app(config(), ServeSettings())
        assert len(second.state.clients) == 1 and second.state.videos is None
        assert "in use by another diffrt server" in caplog.text
        with pytest.raises(Exception, match="in use by another diffrt server"):
            build_app(config(), ServeSettings(video_dir=str(tmp_path / "videos")))  # named: refused
    finally:
        first.state.videos.close()
