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

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from diffrt.engine.input_images import MAX_INPUT_IMAGES
from diffrt.serve.form_parts import (
    Part,
    add_text_field,
    bad,
    json_body,
    part_value,
    read_form_or_json,
)
from diffrt.serve.protocol import ImageEditForm, ImageEditRequest

_IMAGE_PARTS = ("image", "image[]")


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


async def read_edit_body(request: Request) -> tuple[ImageEditForm, EditInputs]:
    """The edit body's fields (an ``ImageEditForm``) and its inputs; a body
    that is neither form is 415, a malformed one 400."""
    got = await read_form_or_json(request, file_fields=(*_IMAGE_PARTS, "mask"))
    return _from_json(got) if isinstance(got, bytes) else _from_parts(got)


# -- JSON ----------------------------------------------------------------------------------
def _from_json(body: bytes) -> tuple[ImageEditForm, EditInputs]:
    try:
        doc = ImageEditRequest.model_validate(json_body(body))
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
        raise bad(f"{param}: file ids are not served here; send the image as a data: URL",
                   param)
    if set(item) != {"image_url"}:
        raise bad(f'{param}: an object must be {{"image_url": "data:..."}}', param)
    return item["image_url"]


def _from_parts(parts: list[Part]) -> tuple[ImageEditForm, EditInputs]:
    images: list[bytes | str] = []
    mask: bytes | str | None = None
    fields: dict[str, Any] = {}
    for part in parts:
        if part.name in _IMAGE_PARTS:
            images.append(part_value(part))
        elif part.name == "mask":
            if mask is not None:
                raise bad("mask: give one mask", "mask")
            mask = part_value(part)
        else:
            add_text_field(fields, part)
    form = _validated(fields)
    if not images:
        raise bad("image: required (a file part named image, or image[] for several)",
                   "image")
    if len(images) > MAX_INPUT_IMAGES:
        raise bad(f"image: at most {MAX_INPUT_IMAGES} images, got {len(images)}", "image")
    inputs = EditInputs(images_field="image")
    names = ["image"] if len(images) == 1 else [f"image[{i}]" for i in range(len(images))]
    inputs.images = list(zip(names, images, strict=True))
    if mask is not None:
        inputs.mask = ("mask", mask)
    return form, inputs


def _validated(fields: dict[str, Any]) -> ImageEditForm:
    """The text fields as an ``ImageEditForm``: read as the JSON body's types
    (pydantic's lax mode: form fields are all text)."""
    try:
        return ImageEditForm.model_validate(fields, strict=False)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


__all__ = ["EditInputs", "read_edit_body"]
