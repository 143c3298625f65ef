"""``build_app``: the whole server as one ASGI app.

The app owns an ``EngineClient``; its lifespan starts the engine in the
background (so /health and /ready answer while a large model loads) and, at
shutdown, drains and closes it. Mounted inside another app, run this app's lifespan
from yours (Starlette does not run a mounted app's lifespan):

    async with diffrt_app.router.lifespan_context(diffrt_app):
        yield

Protocol models (``protocol.py``), routes (``routes.py``: images;
``edit_routes.py``: image edits; ``lora_routes.py``: the LoRA adapters;
``rollout_routes.py``: sleep and wake;
``status_routes.py``: models, health, readiness, metrics; ``video_routes.py``:
the videos API, its jobs in ``video_store.py`` run by ``video_runs.py``), the answers and
refusals they share (``image_answers.py``, ``error_mapping.py``), the engine
client, errors, metrics and the request middleware live in their own
modules; this one only wires them, so another app can mount the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from diffrt.engine import DiffusionEngine, EngineConfig
from diffrt.serve import (
    edit_routes,
    lora_routes,
    playground,
    rollout_routes,
    routes,
    status_routes,
    video_routes,
    weight_routes,
)
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.errors import install_error_handlers
from diffrt.serve.images import ImageStore
from diffrt.serve.metrics import ServerMetrics
from diffrt.serve.middleware import RequestContext
from diffrt.serve.rollout_store import RolloutStore
from diffrt.serve.settings import ServeSettings
from diffrt.serve.video_disk import default_video_dir
from diffrt.serve.video_metrics import VideoMetrics
from diffrt.serve.video_runs import VideoRuns
from diffrt.serve.video_store import VideoStore


def build_app(config: EngineConfig | None = None, settings: ServeSettings | None = None, *,
              engine: DiffusionEngine | None = None,
              on_ready: Callable[[], None] | None = None,
              on_failed: Callable[[str], None] | None = None,
              client: Any = None, replica: str | None = None) -> FastAPI:
    """The server for ``config`` (an engine started by the app), or around an
    ``engine`` already started (kept open at shutdown: its owner closes it).
    ``on_ready`` runs once the engine is warm; ``on_failed(reason)`` if it
    cannot start. ``client`` replaces the engine client altogether (the Ray
    Serve ingress passes one that sends requests to model replicas;
    ``replica`` then names this process in the metrics)."""
    settings = settings or ServeSettings()
    if client is None:
        client = EngineClient(config, settings, engine=engine, on_ready=on_ready,
                              on_failed=on_failed)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(client.start())
        try:
            yield
        finally:
            await client.drain(settings.shutdown_timeout_s)
            await starting
            if app.state.video_runs is not None:  # what the drain left: failed at a restart
                await app.state.video_runs.close()
                app.state.videos.close()
            await client.close()

    # no trailing-slash redirects: their Location would be built from the Host header
    app = FastAPI(title="diffrt", version=_version(), lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible images API over a diffrt engine.")
    app.state.client = client
    app.state.settings = settings
    app.state.images = ImageStore(ttl_s=settings.url_ttl_s, max_images=settings.url_max_images,
                                  max_bytes=settings.url_max_bytes)
    app.state.rollouts = RolloutStore(ttl_s=settings.rollout_ttl_s,
                                      max_bytes=settings.rollout_max_bytes)
    app.state.metrics = ServerMetrics(client.metric_snapshots, replica=replica,
                                      url_store=app.state.images.usage,
                                      rollout_store=app.state.rollouts.usage)
    app.state.videos, app.state.video_runs = _video_jobs(client, settings, app.state.metrics)
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    app.include_router(routes.router)
    app.include_router(status_routes.router)
    app.include_router(edit_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(rollout_routes.router)
    app.include_router(weight_routes.router)
    app.include_router(video_routes.router)
    app.include_router(playground.router)
    app.add_middleware(RequestContext, settings=settings,
                       on_response=app.state.metrics.count_response)
    return app


def _video_jobs(client: Any, settings: ServeSettings, metrics: ServerMetrics
                ) -> tuple[VideoStore | None, VideoRuns | None]:
    """A video model's job store (``--video-dir``: locked while this server
    runs) and the runs of its jobs; an image model opens none."""
    spec = client.model_spec()
    if spec is None or not spec.frame_factor:
        return None, None
    store = VideoStore(settings.video_dir or default_video_dir(),
                       max_bytes=settings.video_store_bytes, ttl_s=settings.video_ttl_s)
    return store, VideoRuns(store, VideoMetrics(metrics.registry, store.usage))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffrt")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"
