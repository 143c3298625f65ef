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
    """Every model served (the default model's server: the image model, then
    the video model beside it)."""
    return ModelList(data=[_card(client, request.app.state.started_at)
                           for client in request.app.state.clients])


def _card(client: Any, created: int) -> ModelCard:
    spec = client.model_spec()
    info = None if spec is None else ModelInfo(
        family=spec.family, tasks=list(spec.tasks), max_input_images=spec.max_input_images,
        size_multiple=spec.size_multiple,
        max_size=spec.max_size, max_steps=spec.max_steps,
        defaults=msgspec.structs.asdict(spec.defaults),
        default_negative_prompt=spec.default_negative_prompt, cfg_rule=spec.cfg_rule.value,
        step_execution=spec.supports_step_execution)
    return ModelCard(id=client.model_name, created=created, diffrt=info)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine lives (loading included); 503 once it is dead, and
    while it is stalled (the worker call in flight made no progress for
    ``stall_timeout_s``; ``reason`` says so) until progress resumes. The
    served model's engine decides: a second one (the default video model's)
    is listed in ``engines`` with the first, and a failure of it leaves the
    images served (``/v1/videos`` answers 503)."""
    from diffrt.platforms.vendor_packages import import_failures

    clients = request.app.state.clients
    body = _with_engines(clients, [_health(c) for c in clients])
    if request.app.state.client.sleeping():  # on Ray Serve: the deployment (every replica)
        body["sleeping"] = True  # alive: requests wait (or get 503) until POST /wake_up
    broken = import_failures()  # e.g. a torch_musa built for another torch: served on CPU
    if broken:
        body["details"] = {"vendor_import_failures": broken}
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


def _health(client: Any) -> dict[str, Any]:
    alive = client.healthy() or client.state == "starting"
    stall = client.stall() if alive else None
    ok = alive and stall is None
    body: dict[str, Any] = {"status": "ok" if ok else "stalled" if alive else "dead",
                            "state": client.state}
    if stall is not None:
        body["reason"] = stall
    return body


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while taking work; 503 while loading, draining, dead or stalled.
    The served model's engine decides, once a second one (the default video
    model's) is no longer starting: warm, or failed (its ``engines`` entry
    says so; the images are served)."""
    clients = request.app.state.clients
    body = _with_engines(clients, [_ready(c) for c in clients])
    if body["status"] == "ready" and any(c.state == "starting" for c in clients[1:]):
        body = {**body, "status": "unavailable", "state": "starting"}
    return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)


def _ready(client: Any) -> dict[str, Any]:
    ok = client.ready()
    body: dict[str, Any] = {"status": "ready" if ok else "unavailable", "state": client.state}
    stall = None if ok else client.stall()
    if stall is not None:
        body["reason"] = stall
    return body


def _with_engines(clients: tuple[Any, ...], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The served model's answer; with a second engine, ``engines`` lists
    each one's, by model."""
    if len(answers) == 1:
        return answers[0]
    return {**answers[0], "engines": [{"model": c.model_name, **a}
                                      for c, a in zip(clients, answers, strict=True)]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
