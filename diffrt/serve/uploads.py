"""An edit's input images: from the bytes a client sent to the PIL images the
engine takes, each failure a 400 naming the part.

What arrives is a multipart file part's bytes, or a ``data:`` URL (a JSON
body, or a multipart text part). A remote URL (``http:``, ``https:``) is
refused: the server never fetches anything a client names, so no request
makes it reach into the network it sits in.

``decode_image`` decodes as diffusers' ``load_image`` does a file
(``PIL.Image.open``, then ``ImageOps.exif_transpose``, so a photo stands as
its camera meant), keeping the mode: the engine converts an image to RGB
and a mask to grayscale, and a mask's alpha channel is read here first.
Before a pixel is decoded the size in the file's header is checked against
the engine's ``MAX_INPUT_PIXELS``: a decompression bomb (a small file that
expands to gigabytes) is refused from its header. Only the formats clients
send photos and masks in are opened (PNG, JPEG, WebP, GIF, BMP): each
decoder Pillow has is code that bytes from the network reach.

``engine_mask`` settles a mask's convention: with an alpha channel,
OpenAI's (fully transparent pixels are where to edit), turned into the
engine's white = repaint; without one, diffusers' (white repaints), as is.

All of it is CPU work on megabytes: the routes run it off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

import numpy as np

from diffrt.engine.input_images import MAX_INPUT_PIXELS
from diffrt.serve.errors import ApiError

#: the formats Pillow may open for an input image
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: modes with an alpha channel (a palette or grayscale image may carry a
#: transparent colour instead: ``info["transparency"]``)
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.S | re.I)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_data_url(url: str, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL; a remote or other URL is refused."""
    head = url[:16].strip().lower()
    if head.startswith(("http://", "https://")):
        raise _bad(param, "remote URLs are not fetched by this server; send the image itself "
                          "(a multipart file, or a base64 data: URL)")
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise _bad(param, 'must be a base64 data: URL ("data:image/png;base64,...")')
    if "base64" not in [p.strip().lower() for p in match.group(2).split(";")]:
        raise _bad(param, 'must be base64-encoded ("data:image/png;base64,...")')
    try:
        return base64.b64decode(re.sub(r"\s+", "", match.group(3)), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, "is not valid base64") from None


def decode_image(data: bytes, param: str) -> Any:
    """``data`` as an upright PIL image in its own mode (see the module docstring)."""
    import PIL.Image
    import PIL.ImageOps

    if not data:
        raise _bad(param, "is empty")
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=FORMATS)
    except PIL.Image.DecompressionBombError:
        raise _too_large(param, None) from None
    except Exception:
        raise _bad(param, f"is not an image Pillow can read as {', '.join(FORMATS)}") from None
    width, height = image.size
    if width * height > MAX_INPUT_PIXELS:
        raise _too_large(param, (width, height))
    try:
        image.load()
        upright = PIL.ImageOps.exif_transpose(image)
    except Exception as exc:  # a truncated or corrupt file: any decoder error
        raise _bad(param, f"cannot be decoded as {image.format} ({type(exc).__name__}: "
                          f"{str(exc)[:120]})") from None
    return image if upright is None else upright


def _too_large(param: str, size: tuple[int, int] | None) -> ApiError:
    what = f"{size[0]}x{size[1]} is" if size else "is"
    return ApiError(400, f"{param}: {what} more than {MAX_INPUT_PIXELS} pixels; send a smaller "
                         "image", param=param, code="image_too_large")


def has_alpha(image: Any) -> bool:
    """Whether ``image`` carries transparency (an alpha band or a transparent colour)."""
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def engine_mask(mask: Any, param: str = "mask") -> Any:
    """The mask as the engine reads it (white: repaint).

    With an alpha channel: OpenAI's convention, where fully transparent
    pixels (alpha 0) are to be edited; they become white and every other
    pixel black (a grayscale image). A mask with alpha and no transparent
    pixel would edit nothing (an editor that saves every picture with
    alpha, meaning white = repaint) and is refused, saying so. Without
    alpha: diffusers' convention, white (above one half) repaints; returned
    as is."""
    import PIL.Image

    if not has_alpha(mask):
        return mask
    alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
    edit = alpha == 0
    if not edit.any():
        raise _bad(param, "has an alpha channel but no fully transparent pixel, so nothing "
                          "would be edited: with alpha, transparent (alpha 0) marks where to "
                          "edit (OpenAI's convention); save it without alpha for white = "
                          "repaint")
    return PIL.Image.fromarray(np.where(edit, 255, 0).astype(np.uint8))  # mode "L"


def read_input(value: bytes | str, param: str) -> Any:
    """One input as a PIL image: file bytes, or a data: URL."""
    data = from_data_url(value, param) if isinstance(value, str) else value
    return decode_image(data, param)


__all__ = ["FORMATS", "decode_image", "engine_mask", "from_data_url", "has_alpha",
           "read_input"]
