"""The body of ``POST /v1/videos`` in any form a client sends it: its
fields as a ``VideoCreateRequest`` and its first frame (``input_reference``)
still as sent, for the route to decode (``engine/image_files.py``).

- ``multipart/form-data`` (what the ``openai`` client always sends, with or
  without a file): ``input_reference`` a file part, or text (a ``data:``
  URL, or ``input_reference[image_url]``, how the client sends OpenAI's
  ``{"image_url": ...}``); every other part a text field read as the JSON
  body's would be, ``name[key]`` parts making a mapping (``loras[style]``).
- ``application/x-www-form-urlencoded``: the same text fields.
- ``application/json``: the same fields, strictly typed, ``input_reference``
  a ``data:`` URL or ``{"image_url": ...}``.

Refusals name the field (OpenAI's ``param``), as the images API's do.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from diffrt.serve.form_parts import Part, add_text_field, bad, json_body, read_form_or_json
from diffrt.serve.video_protocol import VideoCreateRequest, read_video_fields

#: the part that carries the first frame
REFERENCE = "input_reference"


async def read_video_body(request: Request) -> tuple[VideoCreateRequest, bytes | str | None]:
    """The create body's fields, and its first frame as sent: a file's
    bytes, a URL, or None. The fields keep no image (``input_reference``
    is None in them), so a request waiting for the engine holds it once."""
    got = await read_form_or_json(request, file_fields=(REFERENCE,))
    if isinstance(got, bytes):
        body = read_video_fields(json_body(got), form=False)
        return body, _reference_url(body)
    return _from_parts(got)


def _from_parts(parts: list[Part]) -> tuple[VideoCreateRequest, bytes | str | None]:
    upload: bytes | None = None
    fields: dict[str, Any] = {}
    for part in parts:
        if part.name == REFERENCE and part.filename is not None:
            if upload is not None:
                raise bad(f"{REFERENCE}: give one image", REFERENCE)
            upload = bytes(part.data)
        else:
            add_text_field(fields, part)
    body = read_video_fields(fields, form=True)
    url = _reference_url(body)
    if upload is not None and url is not None:
        raise bad(f"{REFERENCE}: give one image (a file part or a URL, not both)", REFERENCE)
    return body, upload if upload is not None else url


def _reference_url(body: VideoCreateRequest) -> str | None:
    """The body's URL reference, taken out of it."""
    reference = body.input_reference
    body.input_reference = None
    if isinstance(reference, dict):
        return reference["image_url"]
    return reference


__all__ = ["REFERENCE", "read_video_body"]
