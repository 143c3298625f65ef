"""Weight updates over HTTP (docs/rollouts.md): ``POST /v1/weights`` (the
transformer's, ``DiffusionEngine.update_weights``) and ``PUT
/v1/loras/{name}`` (an adapter's factors, ``update_lora``). Both need the API
key (they are under /v1). Under Ray Serve either goes to every model
replica, all or none (``ReplicaClient.update_weights`` / ``update_lora``,
``ray_weights.py``; no ``--lora-dir`` there, so an adapter's is an upload).

Either takes its source two ways:

- JSON ``{"path": ...}``: a file (or folder) on the server, accepted only
  inside the folder the operator named (``--weights-dir`` for the
  transformer, ``--lora-dir`` for adapters: real paths, symlinks resolved,
  as ``POST /v1/loras``), so no client makes the server read a file of its
  choosing.
- ``multipart/form-data`` with a ``file`` part: a safetensors file,
  uploaded (bounded by ``max_upload_body_bytes``, read in memory), handed
  to the engine as tensors (which it writes to shared memory for its
  workers).

The other fields (``version``, and ``policy`` for the transformer) are text
parts of the form or JSON fields. A refusal names its field: a file that is
not safetensors, names the transformer lacks or other shapes are 400 on
``file``/``path``; a rank that read other bytes than the source (checksums)
is 409, and the old weights stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError

from diffrt.engine import InvalidRequestError
from diffrt.engine.errors import EngineError
from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.weight_sync import WeightsMismatchError, next_version
from diffrt.engine.weights.update import WeightUpdateError
from diffrt.serve.error_mapping import engine_error
from diffrt.serve.errors import ApiError, echoed
from diffrt.serve.form_parts import add_text_field, bad, json_body, read_form_or_json
from diffrt.serve.lora_routes import card, confined_path, inside_folder
from diffrt.serve.protocol import (
    ErrorResponse,
    LoraCard,
    LoraUpdateBody,
    WeightsUpdateBody,
    WeightsUpdated,
)

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 415, 501, 503, 504)}
#: the form's part that carries an uploaded safetensors file
FILE_PART = "file"

router = APIRouter()


@dataclass
class Source:
    """What an update names: a confined path or uploaded tensors, the body
    field it came in (``path`` / ``file``: what a refusal names), and the
    body's other fields."""

    value: str | Mapping[str, torch.Tensor]
    param: str
    body: Any


async def read_source(request: Request, model: type[BaseModel], folder: str | None,
                      no_folder: str) -> Source:
    """The update's source and fields from a JSON or multipart body;
    ``folder``: where a path must lie (None: paths refused, 403 saying
    ``no_folder``)."""
    got = await read_form_or_json(request, file_fields=(FILE_PART,))
    fields: dict[str, Any] = {}
    upload: bytes | None = None
    if isinstance(got, bytes):
        doc = json_body(got)
        if not isinstance(doc, dict):
            raise bad("the body must be a JSON object with path (or a multipart/form-data "
                      f"body with a {FILE_PART} part)")
        body = _validated(model, doc, strict=True)
    else:
        for part in got:
            if part.name == FILE_PART:
                if upload is not None or part.filename is None:
                    raise bad(f"{FILE_PART}: one safetensors file part (with a filename)",
                              FILE_PART)
                upload = bytes(part.data)
            else:
                add_text_field(fields, part)
        version = fields.get("version")
        if isinstance(version, str) and version.isascii() and version.isdigit():
            fields["version"] = int(version)  # a form's text: digits are a number
        body = _validated(model, fields, strict=False)
    if upload is not None:
        if body.path is not None:
            raise bad(f"path: give a path or a {FILE_PART} part, not both", "path")
        return Source(await asyncio.to_thread(_tensors, upload), FILE_PART, body)
    if body.path is None:
        raise bad(f"path: required (or upload the file as multipart/form-data, part "
                  f"{FILE_PART!r})", "path")
    if folder is None:
        raise ApiError(403, no_folder, param="path", code="path_source_disabled")
    return Source(body.path, "path", body)


def _validated(model: type[BaseModel], doc: dict[str, Any], *, strict: bool) -> Any:
    try:
        return model.model_validate(doc, strict=strict)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _tensors(data: bytes) -> dict[str, torch.Tensor]:
    """An uploaded safetensors file's tensors; 400 naming ``file`` otherwise."""
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as exc:  # safetensors' own error, or a header it cannot parse
        raise bad(f"{FILE_PART}: not a safetensors file ({exc})", FILE_PART) from None
    if not tensors:
        raise bad(f"{FILE_PART}: the safetensors file holds no tensors", FILE_PART)
    return tensors


def _bodies(model: type[BaseModel]) -> dict[str, Any]:
    """The route's request bodies for the OpenAPI schema (it reads its body
    itself): JSON as ``model``, or a form with the file part instead of ``path``."""
    schema = model.model_json_schema()
    form = {"type": "object", "properties": {
        **{k: v for k, v in schema["properties"].items() if k != "path"},
        FILE_PART: {"type": "string", "format": "binary"}}, "required": [FILE_PART]}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}, "multipart/form-data": {"schema": form}}}}


@router.post("/v1/weights", response_model=WeightsUpdated, responses=_ERRORS,
             response_model_exclude_none=True,
             openapi_extra=_bodies(WeightsUpdateBody))
async def update_weights(request: Request) -> WeightsUpdated:
    """Replace (some of) the transformer's weights without a restart, at a
    step boundary: answers the new version and the checksums once every
    rank has loaded them (``policy``: the running requests finish on their
    weights first, or are aborted)."""
    client = request.app.state.client
    folder = request.app.state.settings.weights_dir
    source = await read_source(request, WeightsUpdateBody, folder, (
        "updating the weights from a path on the server is off: start it with "
        "--weights-dir DIR to allow files inside DIR, or upload the file (multipart/form-data, "
        f"part {FILE_PART!r})"))
    if isinstance(source.value, str):
        assert folder is not None
        source.value = inside_folder(source.value, folder, "--weights-dir")
    body = source.body
    if not client.runtime_loras:  # Ray Serve: every replica, in two phases
        answer: WeightsUpdated = await client.update_weights(
            source.value, version=body.version, policy=body.policy, param=source.param)
        return answer
    engine = client.running_engine()
    try:
        next_version(engine.weights_version, body.version)  # a refusal of its own: 400 version
    except WeightUpdateError as exc:
        raise ApiError(400, f"version: {exc}", param="version", code="invalid_value") from None
    try:
        done = await asyncio.to_thread(engine.update_weights_report, source.value,
                                       version=body.version, policy=body.policy)
    except WeightsMismatchError as exc:
        raise ApiError(409, f"{source.param}: {exc}", param=source.param,
                       code="weights_checksum_mismatch") from None
    except (WeightUpdateError, SafetensorError, OSError) as exc:  # names, shapes, files
        raise ApiError(400, f"{source.param}: {exc}", param=source.param,
                       code="invalid_weights") from None
    except EngineError as exc:
        raise engine_error(exc) from None
    return WeightsUpdated(version=done.version, checksum=done.checksum,
                          rank_checksums=done.rank_checksums)


@router.put("/v1/loras/{name:path}", response_model=LoraCard, responses=_ERRORS,
            openapi_extra=_bodies(LoraUpdateBody))
async def update_lora(name: str, request: Request) -> LoraCard:
    """Give the registered adapter ``name`` new factors: requests accepted
    from now on run with them, those accepted before keep the old ones.
    Answers its object, with the new ``version``."""
    client = request.app.state.client
    lora_dir = request.app.state.settings.lora_dir
    source = await read_source(request, LoraUpdateBody, lora_dir, (
        "reading adapter files on the server is off: start it with --lora-dir DIR, or upload "
        f"the factors (multipart/form-data, part {FILE_PART!r})"))
    if isinstance(source.value, str):
        source.value = confined_path(source.value, lora_dir)
    version = source.body.version
    if not client.runtime_loras:  # Ray Serve: every replica, in two phases
        return card(await client.update_lora(name, source.value, version=version,
                                             param=source.param))
    engine = client.running_engine()
    current = next((i for i in engine.list_loras() if i.name == name), None)
    if current is None:
        raise ApiError(404, f"no LoRA adapter named {echoed(name)}", param="name",
                       code="lora_not_found")
    try:
        next_version(current.version, version)
    except WeightUpdateError as exc:
        raise ApiError(400, f"version: {exc}", param="version", code="invalid_value") from None
    try:
        info = await asyncio.to_thread(engine.update_lora, name, source.value, version=version)
    except KeyError:  # removed meanwhile
        raise ApiError(404, f"no LoRA adapter named {echoed(name)}", param="name",
                       code="lora_not_found") from None
    except (AdapterFileError, WeightUpdateError) as exc:
        raise ApiError(400, f"{source.param}: {exc}", param=source.param,
                       code="invalid_lora_file") from None
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.field, code="invalid_value") from None
    except TimeoutError as exc:
        raise ApiError(504, str(exc), param=source.param, code="timeout") from None
    except EngineError as exc:
        raise engine_error(exc) from None
    return card(info)


__all__ = ["FILE_PART", "Source", "read_source", "router"]
