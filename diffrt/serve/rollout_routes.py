"""A trainer's routes (docs/rollouts.md): ``POST /sleep`` (``?level=1|2``)
and ``POST /wake_up``, as vLLM names them. They need the API key like /v1
(``guards.KEYED_ROUTES``) and one engine behind the server (Ray Serve's
replicas each have their own: 501). While the engine sleeps, requests wait
or get 503 (``ServeSettings.sleep_requests``); /health and /metrics say so.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from diffrt.engine.errors import EngineError
from diffrt.serve.error_mapping import engine_error
from diffrt.serve.errors import ApiError
from diffrt.serve.protocol import ErrorResponse

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 501, 503)}

router = APIRouter()


def _engine(request: Request) -> Any:
    client = request.app.state.client
    if not client.runtime_loras:  # the same rule: one engine behind the server
        raise ApiError(501, "sleep and wake need one engine behind the server (each Ray "
                            "Serve replica has its own)", code="not_implemented")
    return client.running_engine()


@router.post("/sleep", responses=_ERRORS)
async def sleep(request: Request, level: int = 1) -> dict[str, Any]:
    """Put the engine to sleep once its running requests finish (level 1:
    weights to page-locked host memory; 2: the transformer's dropped too);
    answers the bytes the device gave up (0 on the CPU, a no-op for memory)."""
    if level not in (1, 2):
        raise ApiError(400, f"level must be 1 or 2, got {level}", param="level",
                       code="invalid_value")
    engine = _engine(request)
    try:
        report = await asyncio.to_thread(engine.sleep, level)
    except EngineError as exc:
        raise engine_error(exc) from None
    return {"sleeping": True, "level": level, "freed_bytes": report.freed_bytes,
            "pinned_bytes": report.pinned_bytes}


@router.post("/wake_up", responses=_ERRORS)
async def wake_up(request: Request) -> dict[str, Any]:
    """Bring the weights back and admit the waiting requests again."""
    engine = _engine(request)
    try:
        report = await asyncio.to_thread(engine.wake)
    except EngineError as exc:
        raise engine_error(exc) from None
    return {"sleeping": False, "restored_bytes": report.restored_bytes,
            "weights_version": engine.weights_version}
