"""The HTTP routes: OpenAI's images and models endpoints, health, readiness
and metrics. Everything a route needs hangs off ``request.app.state``
(``client``: the EngineClient, ``settings``, ``images``, ``metrics``), so the
router can be mounted in any app ``build_app`` made.

One image request, followed: ``generate`` checks the body (pydantic, then
``to_engine_request``) and hands it to ``EngineClient.run``, whose first output
brings any refusal (capacity: 503/429; the engine's own checks at submission:
a 400 naming the field); then it waits for the final output while watching for
the client to leave (``_until_done_or_gone``), or, for a stream, for the first
output and then sends server-sent events as the outputs come (``_events``).
``/v1/images/edits`` (``edit_routes.py``) reads its body and images its own
way, then takes the same path (``check_body``, ``serve_images``) with its
own event names and field names (an ``ImageRoute``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diffrt.engine import DiffusionOutput, DiffusionRequest, InvalidRequestError, SamplingParams
from diffrt.engine.errors import (
    DeadlineUnmeetableError,
    EngineError,
    EngineRestartingError,
    InputsFullError,
)
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.errors import ApiError
from diffrt.serve.images import MEDIA_TYPES, ImageStore, Reservation, StoreFull, b64, encode_image
from diffrt.serve.protocol import (
    SAMPLING_FIELDS,
    BodyField,
    CacheInfo,
    DiffrtInfo,
    ErrorResponse,
    ImageBody,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelInfo,
    ModelList,
    Timings,
)

logger = logging.getLogger(__name__)

#: how often a waiting request checks that its client is still there
DISCONNECT_POLL_S = 0.1
#: the Retry-After of a request refused while fresh workers start (as for a
#: server still loading: workers take seconds to start)
RESTART_RETRY_AFTER_S = 5
#: the Retry-After of a request whose input images find no room among those
#: of the requests held (they free as those finish: seconds at most)
INPUTS_RETRY_AFTER_S = 1
#: engine field -> the API field a client set it with
_PARAMS = {"height": "size", "width": "size", "num_outputs_per_prompt": "n",
           "sampling_params": "size", "num_inference_steps": "num_inference_steps",
           "deadline_s": "deadline_ms", "timeout_s": "timeout_ms"}

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)}


@dataclass(frozen=True)
class ImageRoute:
    """What differs between the routes that answer with images: the stream's
    event names (``<events>.partial_image``, ``<events>.completed``) and the
    body's names of engine fields beyond ``_PARAMS`` (an edit's images: its
    refusals are reworded with them, "mask_image: ..." as "mask: ...")."""

    events: str
    params: Mapping[str, str] = field(default_factory=dict)


GENERATION = ImageRoute("image_generation")

router = APIRouter()


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
                                       step_execution=client.step_mode)
    return await serve_images(client, body, engine_request, request, GENERATION)


def check_body(body: ImageBody, client: EngineClient) -> None:
    """What an image body may not ask of this server: another model, a
    stream of several images, progress events without step boundaries."""
    if body.model is not None and body.model != client.model_name:
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                            f"{client.model_name!r}", param="model", code="model_not_found")
    if body.stream and body.n != 1:
        raise ApiError(400, "n: must be 1 with stream=true", param="n")
    if body.stream_progress and not client.step_mode:  # previews: the engine's own check
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
        return await _generate(client, body, engine_request, request, created, room, route)
    finally:
        if room is not None:
            room.release()


async def _generate(client: EngineClient, body: ImageBody, engine_request: DiffusionRequest,
                    request: Request, created: int, room: Reservation | None,
                    route: ImageRoute) -> Any:
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
        return StreamingResponse(_events(client, outputs, first, body, route),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          **client.response_headers(first.request_id)})
    final = await _until_done_or_gone(_last(outputs), request, route)
    if final is None:  # the client left: nobody reads an answer
        return Response(status_code=499)
    raise_for_final(final, client)
    response = await _response(final, body, request, created, room)
    response.headers.update(client.response_headers(final.request_id))
    return response


def checked_priority(body: ImageBody, engine_request: DiffusionRequest,
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


def image_url(request: Request, image_id: str) -> str:
    """The URL of a stored image: under ``public_url`` when the server has one,
    else relative to this server (never built from the client's Host)."""
    path = request.scope.get("root_path", "") + request.app.url_path_for(
        "image_content", image_id=image_id)
    public = request.app.state.settings.public_url
    return f"{public.rstrip('/')}{path}" if public else path


def invalid(exc: InvalidRequestError, route: ImageRoute = GENERATION) -> ApiError:
    """The 400 of an engine refusal, naming the field as the body names it."""
    message = str(exc)
    param = route.params.get(exc.field)
    if param is None:
        param = _PARAMS.get(exc.field, exc.field)
    elif message.startswith(f"{exc.field}: "):
        message = f"{param}: {message[len(exc.field) + 2:]}"
    return ApiError(400, message, param=param, code="invalid_value")


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
        raise ApiError(400, f'size: must be "WxH" in pixels or "auto", got {size!r}',
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


def engine_error(exc: EngineError) -> ApiError:
    """The answer of an engine that refused a request: 429 when its deadline
    cannot be met behind the queue (``reject_unmeetable``; retry when the
    engine expects the queue to have drained enough) or when the input images
    it holds leave no room for this one's (retry after
    ``INPUTS_RETRY_AFTER_S``), 503 restarting (retry after
    ``RESTART_RETRY_AFTER_S``) or down."""
    if isinstance(exc, DeadlineUnmeetableError):
        return ApiError(429, str(exc), param="deadline_ms", code="deadline_unmeetable",
                        headers={"Retry-After": str(int(exc.retry_after_s))})
    if isinstance(exc, InputsFullError):
        return ApiError(429, f"{exc}; retry shortly", code="input_images_full",
                        headers={"Retry-After": str(INPUTS_RETRY_AFTER_S)})
    if isinstance(exc, EngineRestartingError):
        return ApiError(503, str(exc), code="engine_restarting",
                        headers={"Retry-After": str(RESTART_RETRY_AFTER_S)})
    return ApiError(503, f"the engine is down: {exc}", code="engine_down")


def raise_for_final(out: DiffusionOutput, client: EngineClient) -> None:
    """The HTTP error for a final output that carries no image."""
    if out.ok:
        return
    if out.timed_out:
        raise ApiError(504, out.error or "the request timed out", code="timeout")
    if out.aborted:
        raise ApiError(503, "the server is shutting down; the request was stopped",
                       code="shutting_down")
    if not client.healthy():
        raise ApiError(503, f"the engine failed: {out.error}", code="engine_down")
    raise ApiError(500, f"generation failed: {out.error}", code="generation_failed")


def _timings(out: DiffusionOutput) -> Timings:
    m = out.metrics
    output = None if m.output_wait is None else m.output_wait + (m.postprocess_time or 0.0)
    # both times from the engine's clock (a replica may run on another machine)
    total = None if m.finished_time is None else m.finished_time - m.arrival_time
    return Timings(queue=m.queue_wait, inference=m.forward_time, output=output, total=total)


def _cache(out: DiffusionOutput) -> CacheInfo | None:
    cache = out.metrics.cache
    return None if cache is None else CacheInfo(**msgspec.structs.asdict(cache))


def _info(out: DiffusionOutput) -> DiffrtInfo:
    return DiffrtInfo(request_id=out.request_id, seed=out.seed,
                      num_inference_steps=out.total_steps, timings=_timings(out),
                      cache=_cache(out))


async def _response(out: DiffusionOutput, body: ImageBody, request: Request,
                    created: int, room: Reservation | None) -> Response:
    """The ``ImagesResponse``, encoded off the event loop: PNG/JPEG/WebP, base64
    and JSON are the CPU work of an answer (megabytes for n=10 at 1024 px). It
    is returned as a ready Response, so FastAPI does not validate and
    serialise it a second time (the route's response_model documents it)."""
    images = out.images or []
    urls = None
    if room is not None:
        encoded = await asyncio.to_thread(
            lambda: [encode_image(im, body.output_format, body.output_compression)
                     for im in images])
        media = MEDIA_TYPES[body.output_format]
        urls = [image_url(request, room.put(blob, media)) for blob in encoded]
    width, height = images[0].size if images else (0, 0)
    info = _info(out)

    def build() -> bytes:
        if urls is not None:
            data = [ImageData(url=u) for u in urls]
        else:
            data = [ImageData(b64_json=b64(encode_image(im, body.output_format,
                                                        body.output_compression)))
                    for im in images]
        doc = ImagesResponse(created=created, data=data, output_format=body.output_format,
                             size=f"{width}x{height}", diffrt=info)
        return doc.model_dump_json(exclude_none=True).encode()

    return Response(await asyncio.to_thread(build), media_type="application/json")


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


async def _events(client: EngineClient, outputs: AsyncGenerator[DiffusionOutput, None],
                  first: DiffusionOutput, body: ImageBody, route: ImageRoute
                  ) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI streams them, from ``first`` on
    (``image_generation.*`` or ``image_edit.*``, as ``route`` names them). A
    client that disconnects cancels this generator, and ``client.run``
    aborts the request."""
    partial, completed = f"{route.events}.partial_image", f"{route.events}.completed"
    created = int(time.time())
    common = {"created_at": created, "output_format": body.output_format, "quality": "auto",
              "background": "auto"}
    fmt, compression = body.output_format, body.output_compression

    async def rest() -> AsyncIterator[DiffusionOutput]:
        yield first
        async for out in outputs:
            yield out

    try:
        async for out in rest():
            if out.preview is not None:
                image = out.preview[0]
                text = await asyncio.to_thread(_b64_image, image, fmt, compression)
                yield _sse(partial, {
                    "type": partial, "b64_json": text,
                    "partial_image_index": out.preview_index,
                    "size": f"{image.size[0]}x{image.size[1]}", **common})
            elif not out.finished:
                if body.stream_progress:
                    yield _sse("diffrt.progress", {"type": "diffrt.progress", "step": out.step,
                                                   "total_steps": out.total_steps})
            else:
                raise_for_final(out, client)
                image = out.images[0]  # type: ignore[index]
                text = await asyncio.to_thread(_b64_image, image, fmt, compression)
                yield _sse(completed, {
                    "type": completed, "b64_json": text,
                    "size": f"{image.size[0]}x{image.size[1]}",
                    "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                              "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
                    "diffrt": _info(out).model_dump(), **common})
    except ApiError as exc:
        yield _error_event(exc)
    except InvalidRequestError as exc:
        yield _error_event(invalid(exc, route))
    except EngineError as exc:
        yield _error_event(engine_error(exc))
    except Exception as exc:  # never end a stream without saying why
        logger.exception("stream of %s failed", first.request_id)
        yield _error_event(ApiError(500, f"internal error: {type(exc).__name__}"))
    finally:
        await outputs.aclose()


def _b64_image(image: Any, output_format: str, compression: int | None) -> str:
    """An image as base64 of its encoded bytes (run off the event loop)."""
    return b64(encode_image(image, output_format, compression))


def _error_event(error: ApiError) -> bytes:
    return _sse("error", {"type": "error", "status": error.status, **error.body()})


@router.get("/v1/images/{image_id}/content", name="image_content", responses=_ERRORS)
async def image_content(image_id: str, request: Request) -> Response:
    """An image generated with ``response_format="url"`` (kept for a bounded
    time, count and size). No API key: the random 128-bit id is the
    credential, so the URL works in a browser or an ``<img>``."""
    item = request.app.state.images.get(image_id)
    if item is None:
        raise ApiError(404, f"image {image_id!r} not found (expired or never made)",
                       param="image_id", code="image_not_found")
    data, media_type = item
    return Response(content=data, media_type=media_type)


# -- models, health, metrics --------------------------------------------------------
@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def models(request: Request) -> ModelList:
    client = _client(request)
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

    client = _client(request)
    alive = client.healthy() or client.state == "starting"
    stall = client.stall() if alive else None
    ok = alive and stall is None
    body: dict[str, Any] = {"status": "ok" if ok else "stalled" if alive else "dead",
                            "state": client.state}
    if stall is not None:
        body["reason"] = stall
    broken = import_failures()  # e.g. a torch_musa built for another torch: served on CPU
    if broken:
        body["details"] = {"vendor_import_failures": broken}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while taking work; 503 while loading, draining, dead or stalled."""
    client = _client(request)
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
