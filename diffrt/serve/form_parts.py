"""Form bodies as parts: what ``multipart/form-data`` (OpenAI's forms; what
the ``openai`` client and ``curl -F`` send) and
``application/x-www-form-urlencoded`` (an HTML form's default) carry,
parsed from a body the server has already read within its bound (no
temporary files), and their text fields as a JSON body's would be (each
once; ``name[key]`` parts make a mapping: ``loras[style]=0.8`` is how the
``openai`` client sends ``extra_body={"loras": {...}}``). Read by the image
edits' body (``edit_body.py``) and the videos' (``video_body.py``); a
refusal is a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from diffrt.serve.errors import ApiError, field_name
from diffrt.serve.json_body import loads_unique

#: the parts a multipart body may have
MAX_PARTS = 64
#: the largest text part (a data: URL in a file-ish part is bounded by the body only)
MAX_TEXT_PART_BYTES = 1 << 20
_MAPPING_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]]+)\]")


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


async def read_form_or_json(request: Request, *,
                            file_fields: tuple[str, ...] = ()) -> list[Part] | bytes:
    """A form body's parts (``file_fields``: as ``multipart_parts``), or a
    JSON body's bytes (no Content-Type is read as JSON); another media type
    is 415."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    # read here, not with request.body(), which would keep it on the request
    # for as long as the request waits for the engine
    body = b"".join([chunk async for chunk in request.stream()])
    if media == "multipart/form-data":
        return await asyncio.to_thread(multipart_parts, content_type, body,
                                       file_fields=file_fields)
    if media == "application/x-www-form-urlencoded":
        return await asyncio.to_thread(urlencoded_parts, body)
    if media in ("application/json", ""):
        return body
    raise ApiError(415, "the body must be multipart/form-data, application/json or "
                        f"application/x-www-form-urlencoded, got {media[:80]!r}",
                   code="unsupported_media_type")


def json_body(body: bytes) -> Any:
    """A JSON body's value, each key once (as the generation route reads its
    body: ``json_body.py``); None for an empty body."""
    try:
        return loads_unique(body) if body else None
    except json.JSONDecodeError as exc:
        raise bad(f"the body must be a JSON object (it is not valid JSON: {exc})") from None
    except UnicodeDecodeError:  # json.loads reads bytes as UTF-8 (or -16, -32)
        raise bad("the body must be a JSON object (it is not UTF-8 text)") from None


@dataclass
class Part:
    """One part of a form body: its name, a file's name (None: a text part), its bytes."""

    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


def multipart_parts(content_type: str, body: bytes, *,
                    file_fields: tuple[str, ...] = ()) -> list[Part]:
    """The parts of a multipart body (in a thread: the body may be megabytes);
    a text part is at most ``MAX_TEXT_PART_BYTES`` unless it is one of
    ``file_fields`` (which may carry a ``data:`` URL instead of a file)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise bad("the multipart body has no boundary (Content-Type: multipart/form-data; "
                   "boundary=...)")
    parts: list[Part] = []
    header = [b"", b""]
    headers: dict[bytes, bytes] = {}

    def begin() -> None:
        if len(parts) >= MAX_PARTS:
            raise bad(f"the multipart body has more than {MAX_PARTS} parts")
        parts.append(Part())
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
            raise bad("a multipart part has no name (Content-Disposition: form-data; "
                       'name="...")')
        part.name = name.decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        part.filename = None if filename is None else filename.decode("utf-8", "replace")

    def data(chunk: bytes, start: int, end: int) -> None:
        part = parts[-1]
        part.data += chunk[start:end]
        if part.filename is None and len(part.data) > MAX_TEXT_PART_BYTES and (
                part.name not in file_fields):
            raise bad(f"{field_name(part.name)}: a text field larger than {MAX_TEXT_PART_BYTES} bytes",
                       part.name)

    callbacks = {"on_part_begin": begin, "on_header_field": header_field,
                 "on_header_value": header_value, "on_header_end": header_end,
                 "on_headers_finished": headers_done, "on_part_data": data}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise bad(f"the multipart body cannot be read: {exc}") from None
    return parts


def urlencoded_parts(body: bytes) -> list[Part]:
    """The fields of a urlencoded body, as text parts."""
    from urllib.parse import parse_qsl

    try:
        pairs = parse_qsl(body.decode("ascii"), keep_blank_values=True, strict_parsing=False,
                          max_num_fields=MAX_PARTS, errors="strict")
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"the urlencoded body cannot be read: {exc}") from None
    return [Part(name, None, bytearray(value.encode("utf-8"))) for name, value in pairs]


def part_value(part: Part) -> bytes | str:
    """A file-ish part's content: a file's bytes, or a text part's text (a URL)."""
    if part.filename is not None:
        return bytes(part.data)
    return part_text(part)


def part_text(part: Part) -> str:
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"{field_name(part.name)}: not UTF-8 text (a file part needs a filename)",
                   part.name) from None


def add_text_field(fields: dict[str, Any], part: Part) -> None:
    """A text part into ``fields``: ``name`` once, or ``name[key]`` into a mapping."""
    if part.filename is not None:
        raise bad(f"{field_name(part.name)}: a file where a text field belongs", part.name)
    value = part_text(part)
    mapping = _MAPPING_PART.fullmatch(part.name)
    if mapping is not None:
        name, key = mapping.groups()
        entries = fields.setdefault(name, {})
        if not isinstance(entries, dict) or key in entries:
            raise bad(f"{field_name(part.name)}: given more than once", name)
        entries[key] = value
        return
    if part.name in fields:
        raise bad(f"{field_name(part.name)}: given more than once", part.name)
    fields[part.name] = value


__all__ = ["MAX_PARTS", "MAX_TEXT_PART_BYTES", "Part", "add_text_field", "bad", "json_body",
           "multipart_parts", "part_text", "part_value", "read_form_or_json",
           "urlencoded_parts"]
