"""``POST /v1/images/edits``: OpenAI's image edits over the engine's
image-to-image, inpainting and editing models.

One edit, followed: the body is read in either form (``edit_body.py``:
multipart or JSON), its fields checked as a generation's are
(``routes.check_body``); then, in the decode pool, off the event loop, its
images are decoded (``uploads.py`` with ``engine.image_files``), the mask's
convention settled, the request checked against the model's spec (its
tasks, how many images it takes, the size) and its images converted to the
engine's arrays at the size the model takes them (``to_arrays`` with
``ModelSpec.input_size``, what submission would do; the rule keeps a size
it made, so the engine's own conversion is then a copy: the same pixels,
and none of the work on the event loop). A model whose text encoder reads
its inputs at another size (``ModelSpec.prompt_image_size``: Qwen-Image-Edit
Plus) gets the decoded images as they are: those copies are made from the
originals, at submission. Then it takes the
generations' path (``routes.serve_images``): the same shedding, timeouts,
url images and stream, with OpenAI's edit events
(``image_edit.partial_image``, ``image_edit.completed``).

The decode pool has ``DECODE_THREADS`` threads: decoding is CPU work, and
what a decode holds at its peak (up to ``MAX_INPUT_IMAGES`` + 1 images of
``MAX_INPUT_PIXELS``) is bounded by how many run at once, however many
edits arrive; once converted, only the arrays at the model's size remain.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from fastapi import APIRouter, Request

from diffrt.engine import DiffusionRequest, InvalidRequestError
from diffrt.engine.image_files import mask_for_engine
from diffrt.engine.input_images import to_arrays
from diffrt.serve.edit_body import EditInputs, read_edit_body
from diffrt.serve.engine_client import EngineClient
from diffrt.serve.error_mapping import ImageRoute, invalid
from diffrt.serve.protocol import ErrorResponse, ImageEditForm, ImageEditRequest, ImagesResponse
from diffrt.serve.routes import check_body, serve_images, to_engine_request
from diffrt.serve.uploads import read_input

#: edits decoding at once (each a thread of this module's pool)
DECODE_THREADS = 2
_DECODER = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="diffrt-decode")

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 429, 500, 503, 504)}


def _body_schema() -> dict[str, Any]:
    """The two forms of the body, for /openapi.json (the route reads the body
    itself, so FastAPI cannot describe it from a parameter)."""
    form = ImageEditForm.model_json_schema()
    form["properties"] = {
        "image": {"type": "string", "format": "binary",
                  "description": "the image to edit (several: parts named image[])"},
        "mask": {"type": "string", "format": "binary", "description": (
            "where to edit the image, as large as it: with an alpha channel, its fully "
            "transparent pixels (OpenAI's convention); without one, white (diffusers')")},
        **form["properties"]}
    form["required"] = ["image", *form.get("required", [])]
    return {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": form},
        "application/json": {"schema": ImageEditRequest.model_json_schema()}}}}


@router.post("/v1/images/edits", response_model=ImagesResponse, responses=_ERRORS,
             openapi_extra=_body_schema())
async def edit(request: Request) -> Any:
    """Edit an image (OpenAI's Images API): image-to-image, or inpainting with
    a mask. multipart/form-data (``image``/``image[]``, ``mask`` file parts)
    or JSON (``images``, ``mask`` as data: URLs). ``stream: true`` answers
    with server-sent events: ``image_edit.partial_image`` previews, then
    ``image_edit.completed``."""
    client: EngineClient = request.app.state.client
    body, inputs = await read_edit_body(request)
    check_body(body, client)
    route = ImageRoute("image_edit", inputs.params())
    loop = asyncio.get_running_loop()
    engine_request = await loop.run_in_executor(
        _DECODER, _prepared, body, inputs, request.state.request_id, client, route)
    del inputs  # what was sent, now the engine's arrays: its room in the budget is free
    release = getattr(request.state, "release_body", None)
    if release is not None:
        release()
    return await serve_images(client, body, engine_request, request, route)


def _prepared(body: ImageEditForm, inputs: EditInputs, request_id: str, client: EngineClient,
              route: ImageRoute) -> DiffusionRequest:
    """The engine request of an edit, its images decoded and (when the
    model's spec is known here) checked and converted (in the decode pool)."""
    try:
        images = [read_input(value, param) for param, value in inputs.images]
        mask = None
        if inputs.mask is not None:
            mask = mask_for_engine(read_input(inputs.mask[1], "mask"))
    except InvalidRequestError as exc:  # named as the client named the input
        raise invalid(exc) from None
    request = to_engine_request(body, request_id, step_execution=client.step_execution,
                                images=images, mask=mask)
    spec = client.model_spec()
    if spec is None:  # a Ray ingress without the model's folder: the replica converts
        return request
    try:
        request.validate()
        resolved = spec.with_defaults(request)
        spec.check(resolved)
        if spec.prompt_image_size(resolved) is not None:
            # its text encoder reads the inputs at a size of their own, made
            # from the originals: the engine converts them (on submission)
            return request
        converted = to_arrays(images, mask, lambda w, h: spec.input_size(resolved, w, h))
    except InvalidRequestError as exc:
        raise invalid(exc, route) from None
    return msgspec.structs.replace(request, images=converted.images,
                                   mask_image=converted.mask)
