"""The body of ``POST /v1/images/edits``, in either form a client sends it:
its fields as an ``ImageEditForm`` and its images still as sent.

- ``multipart/form-data`` (OpenAI's form; what the ``openai`` client and
  ``curl -F`` send): the images are file parts named ``image`` (one) or
  ``image[]`` (several; ``image`` repeated is taken the same way), the mask a
  part named ``mask``; a text part in their place is read as a ``data:``
  URL. Every other part is a text field, read as the JSON body's field of
  the same name would be (``"2"`` for ``n``; ``true``/``false``), and
  ``name[key]`` parts make a mapping (``loras[style]=0.8``: how the
  ``openai`` client sends ``extra_body={"loras": {...}}``).
- ``application/x-www-form-urlencoded`` (an HTML form's default): the same
  text fields, the images as ``data:`` URLs in ``image``/``image[]``.
- ``application/json``: the same fields, strictly typed as in
  ``/v1/images/generations``, with ``images`` (a list of ``data:`` URLs, or
  OpenAI's ``{"image_url": ...}`` objects) and ``mask``.

The request middleware has read the whole body already, within the edit
route's bound (``guards.body_limit``), so the multipart parts are taken
from it in memory (python-multipart's parser, off the event loop): no
temporary files, and nothing read twice. Each input keeps the name the
client gave it (``image``, ``image[1]``, ``images[0]``, ``mask``), which a
refusal names as OpenAI's ``param``.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from diffrt.engine.input_images import MAX_INPUT_IMAGES
from diffrt.serve.errors import ApiError, field_name
from diffrt.serve.json_body import loads_unique
from diffrt.serve.protocol import ImageEditForm, ImageEditRequest

#: the parts a multipart body may have: every field once, the images and the mask
MAX_PARTS = 64
#: the largest text part (a data: URL in a text part is bounded by the body only)
MAX_TEXT_PART_BYTES = 1 << 20
_IMAGE_PARTS = ("image", "image[]")
_MAPPING_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]]+)\]")


@dataclass
class EditInputs:
    """An edit's images and mask as sent: file bytes, or a URL string, each
    with the name a refusal gives it."""

    images: list[tuple[str, bytes | str]] = field(default_factory=list)
    mask: tuple[str, bytes | str] | None = None
    #: the body's name of the engine's ``images`` field ("image" or "images")
    images_field: str = "image"

    def params(self) -> dict[str, str]:
        """Engine field -> the name the client gave it (``images[0]`` -> ``image``)."""
        names = {f"images[{i}]": name for i, (name, _) in enumerate(self.images)}
        return {**names, "images": self.images_field, "mask_image": "mask"}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


async def read_edit_body(request: Request) -> tuple[ImageEditForm, EditInputs]:
    """The edit body's fields (an ``ImageEditForm``) and its inputs; a body
    that is neither form is 415, a malformed one 400."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    # read here, not with request.body(), which would keep it on the request
    # for as long as the request waits for the engine
    body = b"".join([chunk async for chunk in request.stream()])
    if media == "multipart/form-data":
        parts = await asyncio.to_thread(_parts, content_type, body)
        return _from_parts(parts)
    if media == "application/x-www-form-urlencoded":
        return _from_parts(await asyncio.to_thread(_url_parts, body))
    if media in ("application/json", ""):
        return _from_json(body)
    raise ApiError(415, "the body must be multipart/form-data, application/json or "
                        f"application/x-www-form-urlencoded, got {media[:80]!r}",
                   code="unsupported_media_type")


# -- JSON ----------------------------------------------------------------------------------
def _from_json(body: bytes) -> tuple[ImageEditForm, EditInputs]:
    try:  # each key once, as the generation route reads its body (json_body.py)
        doc = ImageEditRequest.model_validate(loads_unique(body) if body else None)
    except json.JSONDecodeError as exc:
        raise _bad(f"the body must be a JSON object (it is not valid JSON: {exc})") from None
    except UnicodeDecodeError:  # json.loads reads bytes as UTF-8 (or -16, -32)
        raise _bad("the body must be a JSON object (it is not UTF-8 text)") from None
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    inputs = EditInputs(images_field="images")
    for i, item in enumerate(doc.images):
        inputs.images.append((f"images[{i}]", _json_image(item, f"images[{i}]")))
    if doc.mask is not None:
        inputs.mask = ("mask", _json_image(doc.mask, "mask"))
    # the inputs are ``inputs``' now: the body the request keeps holds none
    doc.images, doc.mask = [], None
    return doc, inputs


def _json_image(item: str | dict[str, str], param: str) -> str:
    """A JSON input's URL: the string itself, or OpenAI's ``{"image_url": ...}``."""
    if isinstance(item, str):
        return item
    if "file_id" in item:
        raise _bad(f"{param}: file ids are not served here; send the image as a data: URL",
                   param)
    if set(item) != {"image_url"}:
        raise _bad(f'{param}: an object must be {{"image_url": "data:..."}}', param)
    return item["image_url"]


# -- multipart -------------------------------------------------------------------------------
@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


def _parts(content_type: str, body: bytes) -> list[_Part]:
    """The parts of a multipart body (in a thread: the body may be megabytes)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise _bad("the multipart body has no boundary (Content-Type: multipart/form-data; "
                   "boundary=...)")
    parts: list[_Part] = []
    header = [b"", b""]
    headers: dict[bytes, bytes] = {}

    def begin() -> None:
        if len(parts) >= MAX_PARTS:
            raise _bad(f"the multipart body has more than {MAX_PARTS} parts")
        parts.append(_Part())
        headers.clear()

    def header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def header_end() -> None:
        headers[header[0].lower()] = header[1]
        header[0], header[1] = b"", b""

    def headers_done() -> None:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        part = parts[-1]
        name = disposition.get(b"name")
        if name is None:
            raise _bad("a multipart part has no name (Content-Disposition: form-data; "
                       'name="...")')
        part.name = name.decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        part.filename = None if filename is None else filename.decode("utf-8", "replace")

    def data(chunk: bytes, start: int, end: int) -> None:
        part = parts[-1]
        part.data += chunk[start:end]
        if part.filename is None and len(part.data) > MAX_TEXT_PART_BYTES and (
                part.name not in (*_IMAGE_PARTS, "mask")):
            raise _bad(f"{field_name(part.name)}: a text field larger than {MAX_TEXT_PART_BYTES} bytes",
                       part.name)

    callbacks = {"on_part_begin": begin, "on_header_field": header_field,
                 "on_header_value": header_value, "on_header_end": header_end,
                 "on_headers_finished": headers_done, "on_part_data": data}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise _bad(f"the multipart body cannot be read: {exc}") from None
    return parts


def _url_parts(body: bytes) -> list[_Part]:
    """The fields of a urlencoded body, as text parts."""
    from urllib.parse import parse_qsl

    try:
        pairs = parse_qsl(body.decode("ascii"), keep_blank_values=True, strict_parsing=False,
                          max_num_fields=MAX_PARTS, errors="strict")
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"the urlencoded body cannot be read: {exc}") from None
    return [_Part(name, None, bytearray(value.encode("utf-8"))) for name, value in pairs]


def _from_parts(parts: list[_Part]) -> tuple[ImageEditForm, EditInputs]:
    images: list[bytes | str] = []
    mask: bytes | str | None = None
    fields: dict[str, Any] = {}
    for part in parts:
        if part.name in _IMAGE_PARTS:
            images.append(_value(part))
        elif part.name == "mask":
            if mask is not None:
                raise _bad("mask: give one mask", "mask")
            mask = _value(part)
        else:
            _add_field(fields, part)
    form = _validated(fields)
    if not images:
        raise _bad("image: required (a file part named image, or image[] for several)",
                   "image")
    if len(images) > MAX_INPUT_IMAGES:
        raise _bad(f"image: at most {MAX_INPUT_IMAGES} images, got {len(images)}", "image")
    inputs = EditInputs(images_field="image")
    names = ["image"] if len(images) == 1 else [f"image[{i}]" for i in range(len(images))]
    inputs.images = list(zip(names, images, strict=True))
    if mask is not None:
        inputs.mask = ("mask", mask)
    return form, inputs


def _value(part: _Part) -> bytes | str:
    """An image part's content: a file's bytes, or a text part's URL."""
    if part.filename is not None:
        return bytes(part.data)
    return _text(part)


def _text(part: _Part) -> str:
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(f"{field_name(part.name)}: not UTF-8 text (a file part needs a filename)",
                   part.name) from None


def _add_field(fields: dict[str, Any], part: _Part) -> None:
    """A text part into ``fields``: ``name`` once, or ``name[key]`` into a mapping."""
    if part.filename is not None:
        raise _bad(f"{field_name(part.name)}: a file where a text field belongs", part.name)
    value = _text(part)
    mapping = _MAPPING_PART.fullmatch(part.name)
    if mapping is not None:
        name, key = mapping.groups()
        entries = fields.setdefault(name, {})
        if not isinstance(entries, dict) or key in entries:
            raise _bad(f"{field_name(part.name)}: given more than once", name)
        entries[key] = value
        return
    if part.name in fields:
        raise _bad(f"{field_name(part.name)}: given more than once", part.name)
    fields[part.name] = value


def _validated(fields: dict[str, Any]) -> ImageEditForm:
    """The text fields as an ``ImageEditForm``: read as the JSON body's types
    (pydantic's lax mode: form fields are all text)."""
    try:
        return ImageEditForm.model_validate(fields, strict=False)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


__all__ = ["EditInputs", "read_edit_body"]
