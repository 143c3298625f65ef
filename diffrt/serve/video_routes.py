"""The videos routes (OpenAI's ``/v1/videos``): create, retrieve, list,
delete, remix, download (``/content``, with Range requests) and progress as
server-sent events (``/events``). The jobs live in the store
(``app.state.videos``: ``video_store.py``) and run as background tasks the
server owns (``app.state.video_runs``: ``video_runs.py``), so a client that
disconnects after create loses nothing. The body's reading and checks are
``video_body.py`` and ``video_requests.py``; refusals are OpenAI's error
shape naming the field (``error_mapping.py``)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from diffrt.engine import DiffusionRequest
from diffrt.engine.sampling import InvalidRequestError
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.error_mapping import invalid
from diffrt.serve.errors import ApiError, echoed
from diffrt.serve.images import StoreFull
from diffrt.serve.protocol import ErrorResponse
from diffrt.serve.routes import checked_priority, counted_from_arrival
from diffrt.serve.uploads import read_input
from diffrt.serve.video_body import REFERENCE, read_video_body
from diffrt.serve.video_jobs import VideoJob, is_job_id
from diffrt.serve.video_protocol import (
    VideoContentQuery,
    VideoCreateRequest,
    VideoDeleted,
    VideoList,
    VideoListQuery,
    VideoObject,
    VideoRemixRequest,
    read_video_fields,
)
from diffrt.serve.video_requests import VIDEO_ROUTE, plan_video
from diffrt.serve.video_runs import VideoRuns, estimate_bytes, settings_of
from diffrt.serve.video_store import VideoStore

#: the bytes one read of a file sends
CHUNK = 1 << 16
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 416, 429, 503)}

router = APIRouter()


def _store(request: Request) -> VideoStore:
    store = getattr(request.app.state, "videos", None)
    if store is None:
        client = request.app.state.client
        if getattr(request.app.state, "default_video_skipped", False):
            raise ApiError(404, f"{client.model_name} makes images, and the default video model "
                                "could not be set up beside it (the server's log says why)",
                           code="not_found")
        raise ApiError(404, f"{client.model_name} makes images, not video: /v1/videos is "
                            "served with a video model (e.g. tiny-wan), or beside the "
                            "default model unless --no-default-video", code="not_found")
    return store


def owner(request: Request) -> str | None:
    """Whose jobs ``request`` sees: its API key's digest when the server has
    several keys (set by the middleware), everyone's (None) otherwise. To
    another owner a job does not exist: 404, as OpenAI answers for another
    organisation's objects."""
    return getattr(request.state, "owner", None)


def _job(request: Request, video_id: str) -> VideoJob:
    job = _store(request).get(video_id, owner(request)) if is_job_id(video_id) else None
    if job is None:
        raise ApiError(404, f"video {echoed(video_id)} not found", param="video_id",
                       code="video_not_found")
    return job


@router.post("/v1/videos", response_model=VideoObject, responses=_ERRORS,
             openapi_extra={"requestBody": {"content": {
                 "multipart/form-data": {"schema": VideoCreateRequest.model_json_schema()},
                 "application/json": {"schema": VideoCreateRequest.model_json_schema()}}}})
async def create_video(request: Request) -> Any:
    """Start a video job (OpenAI's ``client.videos.create``): answered at
    once, queued; poll ``GET /v1/videos/{id}`` or follow ``/events``."""
    _store(request)
    body, reference = await read_video_body(request)
    frame = None
    if reference is not None:
        try:
            frame = await asyncio.to_thread(read_input, reference, REFERENCE)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param=REFERENCE, code="invalid_value") from None
    return await _start(request, body, frame, remixed_from=None)


@router.post("/v1/videos/{video_id}/remix", response_model=VideoObject, responses=_ERRORS)
async def remix_video(video_id: str, remix: VideoRemixRequest, request: Request) -> Any:
    """A new job with a finished job's settings and a new prompt."""
    source = _job(request, video_id)
    if source.status != "completed":
        raise ApiError(400, f"video {video_id} is {source.status}: only a completed video is "
                            "remixed", param="video_id", code="invalid_value")
    body = read_video_fields({**source.settings, "prompt": remix.prompt}, form=False)
    return await _start(request, body, None, remixed_from=video_id)


async def _start(request: Request, body: VideoCreateRequest, frame: Any, *,
                 remixed_from: str | None) -> Any:
    client: EngineClient = request.app.state.video_client
    store = _store(request)
    if body.model is not None and body.model != client.model_name:
        raise ApiError(404, f"model {echoed(body.model)} does not make videos here; /v1/videos "
                            f"on this server runs {client.model_name!r}", param="model",
                       code="model_not_found")
    spec = client.model_spec()
    assert spec is not None
    plan = plan_video(body, request.state.request_id, spec,
                      step_execution=client.step_execution, first_frame=frame)
    engine_request: DiffusionRequest = counted_from_arrival(
        checked_priority(body, plan.request, request), request)
    opened = client.open_run(engine_request)  # 429/503 before a job exists
    try:
        # what the engine would refuse at submission (its cost limit, a field
        # the family refuses, an adapter): a 400 now, not a job that fails
        await client.check(engine_request)
    except InvalidRequestError as exc:
        opened[1].release()
        raise _refused(exc, body) from None
    except BaseException:
        opened[1].release()
        raise
    try:
        job = await asyncio.to_thread(
            store.create, model=client.model_name, seconds=plan.seconds, size=plan.size,
            prompt=body.prompt, owner=owner(request), settings=settings_of(body),
            remixed_from=remixed_from,
            reserve_bytes=estimate_bytes(plan.num_frames, plan.height, plan.width))
    except StoreFull as exc:
        opened[1].release()
        raise ApiError(429, str(exc), code="video_store_full",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    except ValueError as exc:
        opened[1].release()
        raise ApiError(400, str(exc), param="seconds" if body.seconds else "num_frames",
                       code="invalid_value") from None
    except BaseException:
        opened[1].release()
        raise
    runs: VideoRuns = request.app.state.video_runs
    runs.start(job, opened)
    return job.public()


def _refused(exc: InvalidRequestError, body: VideoCreateRequest) -> ApiError:
    """The 400 of an engine refusal, naming the body's field. The run-time
    estimate (``max_request_seconds``) is of the whole clip: it names the
    first of the fields that set its length and cost the body gave."""
    if exc.field != "sampling_params":
        return invalid(exc, VIDEO_ROUTE)
    param = next((name for name in ("seconds", "num_frames", "size", "num_inference_steps")
                  if getattr(body, name, None) is not None), "seconds")
    return ApiError(400, f"{param}: the clip {exc.reason}", param=param, code="invalid_value")


@router.get("/v1/videos/{video_id}", response_model=VideoObject, responses=_ERRORS)
async def retrieve_video(video_id: str, request: Request) -> Any:
    return _job(request, video_id).public()


@router.get("/v1/videos", response_model=VideoList, responses=_ERRORS)
async def list_videos(request: Request, query: Annotated[VideoListQuery, Depends()]) -> Any:
    """The jobs, newest first by default (OpenAI's cursor: ``after``, ``limit``)."""
    try:
        page = _store(request).list(owner(request), after=query.after, limit=query.limit,
                                    order=query.order)
    except KeyError:
        raise ApiError(400, f"after: {echoed(query.after)} is not one of your videos",
                       param="after", code="invalid_value") from None
    return page.public()


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=_ERRORS)
async def delete_video(video_id: str, request: Request) -> Any:
    """Delete a job and its files; a running one is aborted in the engine first."""
    _job(request, video_id)
    runs: VideoRuns = request.app.state.video_runs
    await runs.abort(video_id)
    deleted = await asyncio.to_thread(_store(request).delete, video_id, owner(request))
    if deleted is None:
        raise ApiError(404, f"video {echoed(video_id)} not found", param="video_id",
                       code="video_not_found")
    return {"id": video_id, "object": "video.deleted", "deleted": True}


@router.get("/v1/videos/{video_id}/content", responses=_ERRORS)
async def video_content(video_id: str, request: Request,
                        query: Annotated[VideoContentQuery, Depends()]) -> Response:
    """A completed job's file: the MP4 (Range requests answered 206, for
    seeking), its first frame (``thumbnail``, PNG) or ``spritesheet`` (JPEG)."""
    job = _job(request, video_id)
    opened = await asyncio.to_thread(_store(request).open_file, video_id, owner(request),
                                    query.variant)
    if opened is None:
        raise ApiError(404, f"video {video_id} has no {query.variant} (it is {job.status})",
                       param="variant", code="video_not_ready")
    handle, size, media_type = opened
    start, end = 0, size - 1
    status, headers = 200, {"Accept-Ranges": "bytes"}
    ranged = request.headers.get("range")
    if ranged is not None:
        match = _RANGE.fullmatch(ranged.strip())
        if match is None or not any(match.groups()):
            handle.close()
            raise ApiError(416, f"range: must be bytes=START-END, got {echoed(ranged)}",
                           code="range_not_satisfiable",
                           headers={"Content-Range": f"bytes */{size}"})
        first, last = match.groups()
        if first:
            start, end = int(first), min(int(last), size - 1) if last else size - 1
        else:  # a suffix: the last N bytes
            start = max(0, size - int(last))
        if start > end or start >= size:
            handle.close()
            raise ApiError(416, f"range: {ranged} is outside the file's {size} bytes",
                           code="range_not_satisfiable",
                           headers={"Content-Range": f"bytes */{size}"})
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(end - start + 1)
    return StreamingResponse(_read(handle, start, end - start + 1), status_code=status,
                             media_type=media_type, headers=headers)


async def _read(handle: Any, start: int, length: int) -> AsyncIterator[bytes]:
    try:
        await asyncio.to_thread(handle.seek, start)
        while length > 0:
            data = await asyncio.to_thread(handle.read, min(CHUNK, length))
            if not data:
                return
            length -= len(data)
            yield data
    finally:
        handle.close()


@router.get("/v1/videos/{video_id}/events", responses=_ERRORS)
async def video_events(video_id: str, request: Request) -> StreamingResponse:
    """The job's states as server-sent events: ``video.in_progress`` (with
    ``progress``) as the steps run, then ``video.completed`` or
    ``video.failed``, each event's data the job object; a chunked model's
    (Helios) ``video.chunk`` events between them, each a finished chunk's
    frames as a base64 animated WebP (docs/videos.md)."""
    _job(request, video_id)
    runs: VideoRuns = request.app.state.video_runs

    async def events() -> AsyncIterator[bytes]:
        async for name, data in runs.watch(video_id, owner(request)):
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


__all__ = ["router"]
