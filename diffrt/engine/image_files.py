"""Image files as the PIL images a ``DiffusionRequest`` takes: what the
server does with an uploaded file and ``diffrt generate --image`` with a
path, so both read a file the same way.

``decode_image`` decodes as diffusers' ``load_image`` does a file
(``PIL.Image.open``, then ``ImageOps.exif_transpose``, so a photo stands as
its camera meant), keeping the mode: submission converts an image to RGB
and a mask to grayscale (``input_images``), and a mask's alpha channel is
read first (``mask_for_engine``). Before a pixel is decoded the size in the
file's header is checked against ``MAX_INPUT_PIXELS``: a decompression bomb
(a small file that expands to gigabytes) is refused from its header. Only
the formats photos and masks come in are opened (PNG, JPEG, WebP, GIF,
BMP): every decoder Pillow has is code that bytes from a network reach.

``mask_for_engine`` settles a mask file's convention: with an alpha
channel, OpenAI's (fully transparent pixels are where to edit), turned into
the engine's white = repaint; without one, diffusers' (white repaints), as
is. Refusals are ``InvalidRequestError`` naming the input as the caller
calls it (``image``, ``images[0]``, ``mask``, a flag).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

from diffrt.engine.input_images import MAX_INPUT_PIXELS
from diffrt.engine.sampling import InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

#: the formats Pillow may open for an input image
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: modes with an alpha band (a palette or grayscale image may carry a
#: transparent colour instead: ``info["transparency"]``)
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def decode_image(data: bytes, field: str) -> Image:
    """``data`` (a file's bytes) as an upright PIL image in its own mode."""
    import PIL.Image
    import PIL.ImageOps

    if not data:
        raise InvalidRequestError(field, "is empty")
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=FORMATS)
    except PIL.Image.DecompressionBombError:
        raise _too_large(field, None) from None
    except Exception:
        raise InvalidRequestError(
            field, f"is not an image file Pillow reads as {', '.join(FORMATS)}") from None
    width, height = image.size
    if width * height > MAX_INPUT_PIXELS:
        raise _too_large(field, (width, height))
    try:
        image.load()
        upright = PIL.ImageOps.exif_transpose(image)
    except Exception as exc:  # a truncated or corrupt file: whatever its decoder raised
        raise InvalidRequestError(field, f"cannot be decoded as {image.format} "
                                         f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return image if upright is None else upright


def _too_large(field: str, size: tuple[int, int] | None) -> InvalidRequestError:
    what = f"{size[0]}x{size[1]} is" if size else "is"
    return InvalidRequestError(field, f"{what} more than {MAX_INPUT_PIXELS} pixels; give a "
                                      "smaller image")


def has_alpha(image: Image) -> bool:
    """Whether ``image`` carries transparency (an alpha band or a transparent colour)."""
    return image.mode in _ALPHA_MODES or "transparency" in image.info


def mask_for_engine(mask: Image, field: str = "mask") -> Image:
    """A mask file's image as the engine reads masks (white: repaint).

    With an alpha channel: OpenAI's convention, where fully transparent
    pixels (alpha 0) are to be edited; they become white and every other
    pixel black (a grayscale image). A mask with alpha and no transparent
    pixel would edit nothing (made by an editor that saves every picture
    with alpha, meaning white = repaint) and is refused, saying so. Without
    alpha: diffusers' convention, white (above one half) repaints; returned
    as is."""
    import PIL.Image

    if not has_alpha(mask):
        return mask
    alpha = np.asarray(mask.convert("RGBA").getchannel("A"))
    edit = alpha == 0
    if not edit.any():
        raise InvalidRequestError(field, (
            "has an alpha channel but no fully transparent pixel, so nothing would be "
            "edited: with alpha, transparent (alpha 0) marks where to edit (OpenAI's "
            "convention); save it without alpha for white = repaint"))
    return PIL.Image.fromarray(np.where(edit, 255, 0).astype(np.uint8))  # mode "L"


__all__ = ["FORMATS", "decode_image", "has_alpha", "mask_for_engine"]
