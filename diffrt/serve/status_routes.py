"""The routes that describe the server rather than make images: the model
(``/v1/models``), liveness (``/health``), readiness (``/ready``) and the
Prometheus metrics (``/metrics``). Like the images routes, they find what
they need on ``request.app.state``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diffrt.serve.protocol import ErrorResponse, ModelCard, ModelInfo, ModelList

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)}

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def models(request: Request) -> ModelList:
    client = request.app.state.client
    spec = client.model_spec()
    info = None if spec is None else ModelInfo(
        family=spec.family, tasks=list(spec.tasks), max_input_images=spec.max_input_images,
        size_multiple=spec.size_multiple,
        max_size=spec.max_size, max_steps=spec.max_steps,
        defaults=msgspec.structs.asdict(spec.defaults),
        default_negative_prompt=spec.default_negative_prompt, cfg_rule=spec.cfg_rule.value,
        step_execution=spec.supports_step_execution)
    return ModelList(data=[ModelCard(id=client.model_name, created=request.app.state.started_at,
                                     diffrt=info)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine lives (loading included); 503 once it is dead, and
    while it is stalled (the worker call in flight made no progress for
    ``stall_timeout_s``; ``reason`` says so) until progress resumes."""
    from diffrt.platforms.vendor_packages import import_failures

    client = request.app.state.client
    alive = client.healthy() or client.state == "starting"
    stall = client.stall() if alive else None
    ok = alive and stall is None
    body: dict[str, Any] = {"status": "ok" if ok else "stalled" if alive else "dead",
                            "state": client.state}
    if stall is not None:
        body["reason"] = stall
    if client.sleeping():  # on Ray Serve: the deployment (every replica)
        body["sleeping"] = True  # alive: requests wait (or get 503) until POST /wake_up
    broken = import_failures()  # e.g. a torch_musa built for another torch: served on CPU
    if broken:
        body["details"] = {"vendor_import_failures": broken}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while taking work; 503 while loading, draining, dead or stalled."""
    client = request.app.state.client
    ok = client.ready()
    body: dict[str, Any] = {"status": "ready" if ok else "unavailable", "state": client.state}
    stall = None if ok else client.stall()
    if stall is not None:
        body["reason"] = stall
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
