"""An image route's answers: the ``ImagesResponse`` of a final output
(images encoded off the event loop, as URLs or base64) and the server-sent
events of a stream (previews, progress, the completed image, or an error
event: a stream never ends without saying why).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from diffrt.engine import DiffusionOutput, InvalidRequestError
from diffrt.engine.errors import EngineError
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.error_mapping import ImageRoute, engine_error, invalid, raise_for_final
from diffrt.serve.errors import ApiError
from diffrt.serve.images import MEDIA_TYPES, Reservation, b64, encode_image, served_url
from diffrt.serve.protocol import (
    CacheInfo,
    DiffrtInfo,
    ImageBody,
    ImageData,
    ImagesResponse,
    Timings,
)
from diffrt.serve.rollout_store import RolloutRoom

logger = logging.getLogger(__name__)


def image_url(request: Request, image_id: str) -> str:
    """The URL of a stored image (``images.served_url``)."""
    return served_url(request, "image_content", image_id=image_id)


def _timings(out: DiffusionOutput) -> Timings:
    m = out.metrics
    output = None if m.output_wait is None else m.output_wait + (m.postprocess_time or 0.0)
    # both times from the engine's clock (a replica may run on another machine)
    total = None if m.finished_time is None else m.finished_time - m.arrival_time
    return Timings(queue=m.queue_wait, inference=m.forward_time, output=output, total=total)


def _cache(out: DiffusionOutput) -> CacheInfo | None:
    cache = out.metrics.cache
    return None if cache is None else CacheInfo(**msgspec.structs.asdict(cache))


async def _info(out: DiffusionOutput, rollout: RolloutRoom | None) -> DiffrtInfo:
    """diffrt's extension of an answer; a rollout asked for is kept now
    (``rollout_store.py``) and the answer says where."""
    return DiffrtInfo(request_id=out.request_id, seed=out.seed,
                      num_inference_steps=out.total_steps, timings=_timings(out),
                      cache=_cache(out), weights_version=out.weights_version, seeds=out.seeds,
                      lora_versions=out.lora_versions or None,
                      rollout=None if rollout is None else await rollout.keep(out))


async def image_response(out: DiffusionOutput, body: ImageBody, request: Request,
                         created: int, room: Reservation | None,
                         rollout: RolloutRoom | None = None) -> Response:
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
    info = await _info(out, rollout)

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


async def image_events(client: EngineClient, outputs: AsyncGenerator[DiffusionOutput, None],
                       first: DiffusionOutput, body: ImageBody, route: ImageRoute,
                       rollout: RolloutRoom | None = None) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI streams them, from ``first`` on
    (``image_generation.*`` or ``image_edit.*``, as ``route`` names them; the
    completed event's ``diffrt`` says where a rollout asked for waits). A
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
            if isinstance(out.preview, list):  # PIL images: the server asks for "pil"
                image = out.preview[0]
                assert not isinstance(image, list)  # a clip's frames: no image route runs a video
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
                assert out.images is not None  # a final output it let through has images
                image = out.images[0]
                text = await asyncio.to_thread(_b64_image, image, fmt, compression)
                yield _sse(completed, {
                    "type": completed, "b64_json": text,
                    "size": f"{image.size[0]}x{image.size[1]}",
                    "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                              "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
                    "diffrt": (await _info(out, rollout)).model_dump(), **common})
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


class ReleasingStream(StreamingResponse):
    """A stream that runs ``on_close`` once it is over, sent or not (a client
    gone before the first event never starts the generator, whose own
    ``finally`` then never runs): a stream's rollout room is given back here."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None,
                 **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def _b64_image(image: Any, output_format: str, compression: int | None) -> str:
    """An image as base64 of its encoded bytes (run off the event loop)."""
    return b64(encode_image(image, output_format, compression))


def _error_event(error: ApiError) -> bytes:
    return _sse("error", {"type": "error", "status": error.status, **error.body()})


__all__ = ["ReleasingStream", "image_events", "image_response", "image_url"]
