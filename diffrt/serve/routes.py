"""The images routes: ``POST /v1/images/generations`` and the stored images
of ``response_format="url"``. Everything a route needs hangs off
``request.app.state`` (``client``: the EngineClient, ``settings``,
``images``, ``metrics``), so the router can be mounted in any app
``build_app`` made; the model, health, readiness and metrics routes are in
``status_routes.py``, the adapters' in ``lora_routes.py``.

One image request, followed: ``generate`` checks the body (pydantic, then
``to_engine_request``) and hands it to ``EngineClient.run``, whose first output
brings any refusal (capacity: 503/429; the engine's own checks at submission:
a 400 naming the field; ``error_mapping.py``); then it waits for the final
output while watching for the client to leave (``_until_done_or_gone``), or,
for a stream, for the first output and then sends server-sent events as the
outputs come (``image_answers.py``). ``/v1/images/edits`` (``edit_routes.py``)
reads its body and images its own way, then takes the same path
(``check_body``, ``serve_images``) with its own event names and field names
(an ``ImageRoute``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from diffrt.engine import DiffusionOutput, DiffusionRequest, InvalidRequestError, SamplingParams
from diffrt.engine.errors import EngineError
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.error_mapping import (
    GENERATION,
    ImageRoute,
    engine_error,
    invalid,
    raise_for_final,
)
from diffrt.serve.errors import ApiError, echoed
from diffrt.serve.image_answers import ReleasingStream, image_events, image_response
from diffrt.serve.images import ImageStore, Reservation, StoreFull
from diffrt.serve.json_body import StrictJsonRoute
from diffrt.serve.protocol import (
    SAMPLING_FIELDS,
    BodyField,
    ErrorResponse,
    ImageBody,
    ImageGenerationRequest,
    ImagesResponse,
)
from diffrt.serve.rollout_store import RolloutRoom, reserve_rollout

#: how often a waiting request checks that its client is still there
DISCONNECT_POLL_S = 0.1

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)}


router = APIRouter(route_class=StrictJsonRoute)  # each JSON key once


def _client(request: Request) -> EngineClient:
    return request.app.state.client


# -- images ---------------------------------------------------------------------------
# The API key of /v1/* is checked by the request middleware, before the body
# is read (guards.py).
@router.post("/v1/images/generations", response_model=ImagesResponse, responses=_ERRORS)
async def generate(body: ImageGenerationRequest, request: Request) -> Any:
    """Generate images (OpenAI's Images API). ``stream: true`` answers with
    server-sent events: ``image_generation.partial_image`` previews, then
    ``image_generation.completed``."""
    client = _client(request)
    check_body(body, client)
    engine_request = to_engine_request(body, request.state.request_id,
                                       step_execution=client.step_execution)
    return await serve_images(client, body, engine_request, request, GENERATION)


def check_body(body: ImageBody, client: EngineClient) -> None:
    """What an image body may not ask of this server: another model, a
    stream of several images, progress events without step boundaries."""
    if body.model is not None and body.model != client.model_name:
        raise ApiError(404, f"model {echoed(body.model)} does not make images here; this server's "
                            f"images come from {client.model_name!r}", param="model",
                       code="model_not_found")
    if body.stream and body.n != 1:
        raise ApiError(400, "n: must be 1 with stream=true", param="n")
    if body.stream_progress and not client.step_execution:  # previews: the engine's own check
        raise ApiError(400, "stream_progress: needs a server with step_execution (diffrt serve "
                            "--step-execution, the default)", param="stream_progress")


async def serve_images(client: EngineClient, body: ImageBody, engine_request: DiffusionRequest,
                       request: Request, route: ImageRoute) -> Any:
    """Run ``engine_request`` and answer with its images: a JSON response, or
    (``body.stream``) server-sent events named for ``route``."""
    created = int(time.time())
    engine_request = counted_from_arrival(checked_priority(body, engine_request, request),
                                          request)
    room = _reserve_urls(body, engine_request, request) if body.response_format == "url" else None
    try:
        rollout = reserve_rollout(request, engine_request, client.model_spec())
    except ApiError:
        if room is not None:
            room.release()
        raise
    response = None
    try:
        response = await _generate(client, body, engine_request, request, created, room, route,
                                   rollout)
        return response
    finally:
        if room is not None:
            room.release()
        if rollout is not None and not isinstance(response, ReleasingStream):
            rollout.release()  # a stream's is given back once it has been sent


async def _generate(client: EngineClient, body: ImageBody, engine_request: DiffusionRequest,
                    request: Request, created: int, room: Reservation | None,
                    route: ImageRoute, rollout: RolloutRoom | None) -> Any:
    # capacity (429/503) and the engine's checks (400) answer on the first
    # output, which both paths below await before any response goes out
    outputs = client.run(engine_request)
    if body.stream:
        # The first output is awaited here, before the 200 goes out, so a
        # refusal at submission (429, 503, 400) is an HTTP status, not an
        # error event inside a 200.
        first = await _until_done_or_gone(_anext(outputs), request, route)
        if first is None:
            return Response(status_code=499)
        if first.finished:
            raise_for_final(first, client)
        return ReleasingStream(image_events(client, outputs, first, body, route, rollout),
                               None if rollout is None else rollout.release,
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache",
                                        **client.response_headers(first.request_id)})
    final = await _until_done_or_gone(_last(outputs), request, route)
    if final is None:  # the client left: nobody reads an answer
        return Response(status_code=499)
    raise_for_final(final, client)
    response = await image_response(final, body, request, created, room, rollout)
    response.headers.update(client.response_headers(final.request_id))
    return response


def checked_priority(body: BaseModel, engine_request: DiffusionRequest,
                     request: Request) -> DiffusionRequest:
    """400 for a priority below the server's ``client_priority_floor``; a
    body that names none gets the floor when the floor is above the default."""
    floor = request.app.state.settings.client_priority_floor
    params = engine_request.sampling_params
    if floor is None:
        return engine_request
    if "priority" not in body.model_fields_set and params.priority < floor:
        return msgspec.structs.replace(
            engine_request, sampling_params=msgspec.structs.replace(params, priority=floor))
    if params.priority < floor:
        raise ApiError(400, f"priority: must be >= {floor} on this server, got "
                            f"{params.priority}", param="priority", code="invalid_value")
    return engine_request


def counted_from_arrival(engine_request: DiffusionRequest, request: Request) -> DiffusionRequest:
    """The request with its ``deadline_s`` counted from its arrival at this
    server (the engine counts from its submission): less the time its body
    and images took to read, never below a millisecond (then it is missed)."""
    params = engine_request.sampling_params
    arrived = request.scope.get("state", {}).get("arrived_at")
    if params.deadline_s is None or arrived is None:
        return engine_request
    left = max(1e-3, params.deadline_s - (time.monotonic() - arrived))
    return msgspec.structs.replace(
        engine_request, sampling_params=msgspec.structs.replace(params, deadline_s=left))


def _reserve_urls(body: ImageBody, engine_request: DiffusionRequest,
                  request: Request) -> Reservation:
    """Room in the url store for the request's images, taken at submission: a
    request that does not fit is refused (429) and no image is ever evicted.
    Each image is estimated at its raw RGBA size (a PNG of it is smaller);
    ``size="auto"`` at the store's average share."""
    store: ImageStore = request.app.state.images
    params = engine_request.sampling_params
    if params.height and params.width:
        bytes_each = params.height * params.width * 4 + 4096
    else:
        bytes_each = store.max_bytes // max(1, store.max_images)
    try:
        return store.reserve(body.n, bytes_each)
    except StoreFull as exc:
        raise ApiError(429, str(exc), code="url_store_full",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), param="response_format", code="invalid_value") from None


async def _anext(outputs: AsyncIterator[DiffusionOutput]) -> DiffusionOutput | None:
    return await outputs.__anext__()


async def _last(outputs: AsyncIterator[DiffusionOutput]) -> DiffusionOutput | None:
    final = None
    async for out in outputs:
        final = out
    return final


def to_engine_request(body: Any, request_id: str, *, step_execution: bool = True,
                      images: list[Any] | None = None, mask: Any = None) -> DiffusionRequest:
    """The engine request of a body: its sampling fields by their declared
    names (``protocol.SAMPLING_FIELDS``, those the body's model has), ``size``
    as height and width, and an edit's input images. Previews go only to a
    stream; a body without one asks for none from a STEP_BATCH server, while
    a REQUEST_BATCH server passes them on for the engine to refuse (it has
    no step boundaries to show them at)."""
    height, width = parse_size(body.size)
    fields: dict[str, Any] = {"height": height, "width": width}
    for f in _fields_of(body):
        value = getattr(body, f.http)
        fields[f.field] = value / f.scale if value is not None and f.scale != 1.0 else value
    if not body.stream and step_execution:
        fields["partial_images"] = 0
    return DiffusionRequest(prompt=body.prompt, negative_prompt=body.negative_prompt,
                            request_id=request_id, sampling_params=SamplingParams(**fields),
                            images=list(images or []), mask_image=mask)


def _fields_of(body: Any) -> tuple[BodyField, ...]:
    """The sampling fields ``body``'s model carries (a generation body has no
    ``strength``)."""
    present = type(body).model_fields
    return tuple(f for f in SAMPLING_FIELDS if f.http in present)


def parse_size(size: str) -> tuple[int | None, int | None]:
    """``"WxH"`` -> (height, width); ``"auto"`` -> the model's default."""
    if size == "auto":
        return None, None
    match = re.fullmatch(r"([0-9]{1,5})x([0-9]{1,5})", size)  # ASCII digits only
    if match is None:
        raise ApiError(400, f'size: must be "WxH" in pixels or "auto", got {echoed(size)}',
                       param="size", code="invalid_value")
    return int(match.group(2)), int(match.group(1))


async def _until_done_or_gone(work: Any, request: Request,
                              route: ImageRoute = GENERATION) -> DiffusionOutput | None:
    """``work``'s output, or None once the client disconnected: ``work`` is then
    cancelled, which aborts the request in the engine (``EngineClient.run``)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return _submitted(task, route)
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _submitted(task: asyncio.Future, route: ImageRoute) -> DiffusionOutput:
    """The task's output; a refusal at submission as its HTTP answer."""
    try:
        out = task.result()
    except InvalidRequestError as exc:
        raise invalid(exc, route) from None
    except EngineError as exc:
        raise engine_error(exc) from None
    if out is None:
        raise ApiError(500, "the request ended without an output")
    return out


@router.get("/v1/images/{image_id}/content", name="image_content", responses=_ERRORS)
async def image_content(image_id: str, request: Request) -> Response:
    """An image generated with ``response_format="url"`` (kept for a bounded
    time, count and size). No API key: the random 128-bit id is the
    credential, so the URL works in a browser or an ``<img>``."""
    item = request.app.state.images.get(image_id)
    if item is None:
        raise ApiError(404, f"image {echoed(image_id)} not found (expired or never made)",
                       param="image_id", code="image_not_found")
    data, media_type = item
    return Response(content=data, media_type=media_type)


