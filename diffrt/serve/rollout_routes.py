"""A trainer's routes (docs/rollouts.md): ``POST /sleep`` (``?level=1|2``)
and ``POST /wake_up``, as vLLM names them. They need the API key like /v1
(``guards.KEYED_ROUTES``). On Ray Serve they reach every replica's engine
through the board's rounds (``ReplicaClient.sleep``, ``ray_sleep.py``).
While the engine (or deployment) sleeps, requests wait or get 503
(``ServeSettings.sleep_requests``); /health and /metrics say so.

``GET /v1/rollouts/{id}``: a request's log-probs and trajectory as the
safetensors file ``rollout_store.py`` kept (keyed, and only for the key that
made it); ``DELETE`` frees its room before it expires. The weight updates'
routes are ``weight_routes.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from diffrt.engine.errors import EngineError
from diffrt.engine.weights.update import WeightUpdateError
from diffrt.serve.error_mapping import engine_error
from diffrt.serve.errors import ApiError, echoed
from diffrt.serve.protocol import ErrorResponse

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}

router = APIRouter()


@router.post("/sleep", responses=_ERRORS)
async def sleep(request: Request, level: int = 1) -> dict[str, Any]:
    """Put the engine to sleep once its running requests finish (level 1:
    weights to page-locked host memory; 2: the transformer's dropped too);
    answers the bytes the device gave up (0 on the CPU, a no-op for memory;
    on Ray Serve summed over the replicas, with each one's)."""
    if level not in (1, 2):
        raise ApiError(400, f"level must be 1 or 2, got {level}", param="level",
                       code="invalid_value")
    client = request.app.state.client
    if not client.runtime_loras:  # Ray Serve: every replica, through the board
        answer: dict[str, Any] = await client.sleep(level)
        return answer
    engine = client.running_engine()
    try:
        report = await asyncio.to_thread(engine.sleep, level)
    except EngineError as exc:
        raise engine_error(exc) from None
    except WeightUpdateError as exc:  # quantized or offloaded weights
        raise ApiError(400, str(exc), code="invalid_value") from None
    return {"sleeping": True, "level": level, "freed_bytes": report.freed_bytes,
            "pinned_bytes": report.pinned_bytes}


@router.post("/wake_up", responses=_ERRORS)
async def wake_up(request: Request) -> dict[str, Any]:
    """Bring the weights back and admit the waiting requests again."""
    client = request.app.state.client
    if not client.runtime_loras:  # Ray Serve: every replica, through the board
        answer: dict[str, Any] = await client.wake()
        return answer
    engine = client.running_engine()
    try:
        report = await asyncio.to_thread(engine.wake)
    except EngineError as exc:
        raise engine_error(exc) from None
    return {"sleeping": False, "restored_bytes": report.restored_bytes,
            "weights_version": engine.weights_version}


def _owner(request: Request) -> str | None:
    return getattr(request.state, "owner", None)


def _not_found(rollout_id: str) -> ApiError:
    return ApiError(404, f"rollout {echoed(rollout_id)} not found (expired, deleted, made "
                         "with another API key, or never made)", param="rollout_id",
                    code="rollout_not_found")


@router.get("/v1/rollouts/{rollout_id}", name="rollout_content", responses={
    **_ERRORS, 200: {"content": {"application/octet-stream": {}},
                     "description": "the rollout as a safetensors file"}})
async def rollout_content(rollout_id: str, request: Request) -> Response:
    """A request's log-probs and trajectory (``return_log_probs``,
    ``return_trajectory``) as a safetensors file: ``log_probs``, ``latents``,
    ``timesteps``, ``sigmas`` (what it asked for), with the weights version,
    seeds and prompt in its metadata. Kept for ``--rollout-ttl-s``."""
    item = request.app.state.rollouts.get(rollout_id, _owner(request))
    if item is None:
        raise _not_found(rollout_id)
    data, media_type = item
    return Response(content=data, media_type=media_type, headers={
        "Content-Disposition": f'attachment; filename="rollout-{rollout_id}.safetensors"'})


@router.delete("/v1/rollouts/{rollout_id}", responses=_ERRORS)
async def delete_rollout(rollout_id: str, request: Request) -> dict[str, Any]:
    """Drop a rollout once downloaded: its room is free for the next ones."""
    if not request.app.state.rollouts.delete(rollout_id, _owner(request)):
        raise _not_found(rollout_id)
    return {"id": rollout_id, "object": "rollout", "deleted": True}
