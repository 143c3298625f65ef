"""``build_app``: the whole server as one ASGI app.

The app owns an ``EngineClient``; its lifespan starts the engine in the
background (so /health and /ready answer while a large model loads) and, at
shutdown, drains and closes it. Built for the default model (an image
model), it also owns a second client, of the default video model, which
``/v1/videos`` runs on (``ServeSettings.default_video``): a first server
answers both APIs with a model that draws what its prompt says. Mounted
inside another app, run this app's lifespan from yours (Starlette does not
run a mounted app's lifespan):

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
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI

from diffrt.engine import DiffusionEngine, EngineConfig
from diffrt.engine.settings import DEFAULT_MODEL, DEFAULT_VIDEO_MODEL, ModelConfig
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
from diffrt.serve.engine_client import EngineClient, close_all
from diffrt.serve.errors import install_error_handlers
from diffrt.serve.images import ImageStore
from diffrt.serve.metrics import ServerMetrics
from diffrt.serve.middleware import RequestContext
from diffrt.serve.rollout_store import RolloutStore
from diffrt.serve.settings import ServeSettings
from diffrt.serve.video_disk import DirInUse, default_video_dir
from diffrt.serve.video_metrics import VideoMetrics
from diffrt.serve.video_runs import VideoRuns
from diffrt.serve.video_store import VideoStore

logger = logging.getLogger(__name__)


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
    video_client, store = None, None
    if client is None:
        video_config, store = _default_video(config if engine is None else None, settings)
        ready = _WhenAll(1 if video_config is None else 2, on_ready)
        client = EngineClient(config, settings, engine=engine, on_ready=ready,
                              on_failed=on_failed)
        if video_config is not None:
            video_client = EngineClient(
                video_config, msgspec.structs.replace(settings, model_name=None),
                on_ready=ready, on_failed=lambda reason: _video_failed(reason, ready))
    clients = (client,) if video_client is None else (client, video_client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(_start_in_turn(clients))
        try:
            yield
        finally:
            try:
                await asyncio.gather(*(c.drain(settings.shutdown_timeout_s) for c in clients))
                await starting
                if app.state.video_runs is not None:  # what the drain left: failed at a restart
                    await app.state.video_runs.close()
            finally:
                if app.state.videos is not None:  # its folder's lock, whatever happened
                    app.state.videos.close()
                await close_all(clients)

    # no trailing-slash redirects: their Location would be built from the Host header
    app = FastAPI(title="diffrt", version=_version(), lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible images API over a diffrt engine.")
    app.state.client = client
    #: every engine's client (the served model's first): health, drain, metrics
    app.state.clients = clients
    #: the client /v1/videos runs on: the served model's, or the default video model's
    app.state.video_client = video_client or client
    #: the default video model was wanted but could not be set up (logged why)
    app.state.default_video_skipped = (video_client is None and config is not None
                                       and engine is None
                                       and wants_default_video(config, settings))
    app.state.settings = settings
    app.state.images = ImageStore(ttl_s=settings.url_ttl_s, max_images=settings.url_max_images,
                                  max_bytes=settings.url_max_bytes)
    app.state.rollouts = RolloutStore(ttl_s=settings.rollout_ttl_s,
                                      max_bytes=settings.rollout_max_bytes)
    app.state.metrics = ServerMetrics(_snapshots(clients), replica=replica,
                                      url_store=app.state.images.usage,
                                      rollout_store=app.state.rollouts.usage)
    app.state.videos, app.state.video_runs = _video_jobs(app.state.video_client, settings,
                                                         app.state.metrics, store)
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


async def _start_in_turn(clients: tuple[EngineClient, ...]) -> None:
    """Start the engines one after another, the served model's first: two
    in-process engines loading at once race in the checkpoint loading of
    diffusers and transformers (its empty-weights context patches
    torch.nn.Module for the whole process: the other thread's modules came
    out on the meta device, "Cannot copy out of meta tensor")."""
    for client in clients:
        await client.start()
        if client.state != "ready":  # failed, or shut down meanwhile: no second engine
            return


def wants_default_video(config: EngineConfig, settings: ServeSettings) -> bool:
    """The server's model is the default one and ``default_video`` is on."""
    return settings.default_video and config.model == DEFAULT_MODEL


def default_video_config(config: EngineConfig) -> EngineConfig:
    """The engine of the default video model beside the default image model:
    the server's executor, scheduling and limits, on one rank, with the
    video model's own weights, whole (no adapters, quantization, offload,
    compilation or memory budget: what was given for the image model does
    not fit a Wan of 3 MB)."""
    whole = ModelConfig()
    return config.replace(model=DEFAULT_VIDEO_MODEL, lora_modules={}, quantization="none",
                          text_encoder_quantization="none", offload="none",
                          offload_prefetch=whole.offload_prefetch, compile=False,
                          device_memory_budget=None, cfg_parallel_size=1, ulysses_degree=1,
                          ring_degree=1, vae_parallel=False, world_size=None)


def _default_video(config: EngineConfig | None, settings: ServeSettings
                   ) -> tuple[EngineConfig | None, VideoStore | None]:
    """The default video model's engine and its job store (open), beside the
    default model the app starts; (None, None) for another server, or when
    it cannot be (logged: the images are served)."""
    if config is None or not wants_default_video(config, settings):
        return None, None
    try:
        # a setting of the image model's the copy refuses, or a broken folder
        video_config = default_video_config(config)
        video_config.model_spec()  # its folder whole, before anything starts
    except Exception as exc:
        _video_failed(f"{type(exc).__name__}: {exc}", lambda: None)
        return None, None
    store = _default_video_store(settings)
    return (None, None) if store is None else (video_config, store)


def _video_failed(reason: str, ready: Callable[[], None]) -> None:
    """The default video model could not start: the images are served all
    the same (it is the second engine); ``/v1/videos`` answers 503 naming the
    reason (404 when its folder could not even be read), and ``/health``
    lists it failed."""
    logger.error("the default video model %s could not start (%s); the images are served "
                 "without it (--no-default-video: without trying)", DEFAULT_VIDEO_MODEL, reason)
    ready()


class _WhenAll:
    """``on_ready`` once every one of ``count`` engines has settled (warm, or
    the video engine failed): each client's own callback."""

    def __init__(self, count: int, on_ready: Callable[[], None] | None):
        self.left, self.on_ready = count, on_ready

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0 and self.on_ready is not None:
            self.on_ready()


def _snapshots(clients: tuple[Any, ...]) -> Callable[[], list[tuple[dict[str, str], Any]]]:
    """The engines' stats for /metrics: one engine's as it gives them; two,
    each labelled with its model (``engine="diffrt-motion"``: ``model`` is
    the step-cost fit's label)."""
    if len(clients) == 1:
        return clients[0].metric_snapshots

    def every() -> list[tuple[dict[str, str], Any]]:
        return [({**labels, "engine": c.model_name}, stats)
                for c in clients for labels, stats in c.metric_snapshots()]

    return every


def _default_video_store(settings: ServeSettings) -> VideoStore | None:
    """The job store of the default video model's engine; None (a warning:
    the server makes images only) when ``--video-dir`` was not given and the
    default folder is another server's, so a second default server on the
    host still starts."""
    try:
        return _open_store(settings)
    except DirInUse:
        if settings.video_dir is not None:
            raise
        logger.warning("%s is in use by another diffrt server: this one serves images only, "
                       "without %s (give --video-dir to serve videos too)",
                       default_video_dir(), DEFAULT_VIDEO_MODEL)
        return None


def _open_store(settings: ServeSettings) -> VideoStore:
    return VideoStore(settings.video_dir or default_video_dir(),
                      max_bytes=settings.video_store_bytes, ttl_s=settings.video_ttl_s)


def _video_jobs(client: Any, settings: ServeSettings, metrics: ServerMetrics,
                store: VideoStore | None) -> tuple[VideoStore | None, VideoRuns | None]:
    """A video model's job store (``--video-dir``: locked while this server
    runs; ``store`` when already open) and the runs of its jobs; an image
    model opens none."""
    spec = client.model_spec()
    if spec is None or not spec.frame_factor:
        return None, None
    store = store or _open_store(settings)
    return store, VideoRuns(store, VideoMetrics(metrics.registry, store.usage))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffrt")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"
