"""An edit's inputs as sent, to PIL images: a multipart file part's bytes, or
a ``data:`` URL (a JSON body, or a multipart text part), decoded as every
image file is (``engine.image_files``: Pillow, EXIF orientation, the pixel
bound, a mask's alpha convention).

A remote URL (``http:``, ``https:``) is refused: the server never fetches
anything a client names, so no request makes it reach into the network it
sits in. Refusals are ``InvalidRequestError`` naming the input as the
client named it (``image``, ``image[1]``, ``images[0]``, ``mask``).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from diffrt.engine.image_files import decode_image
from diffrt.engine.sampling import InvalidRequestError

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.S | re.I)


def from_data_url(url: str, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL; a remote or other URL is refused."""
    if url[:16].strip().lower().startswith(("http://", "https://")):
        raise InvalidRequestError(param, (
            "remote URLs are not fetched by this server; send the image itself (a multipart "
            "file, or a base64 data: URL)"))
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise InvalidRequestError(param, 'must be a base64 data: URL ("data:image/png;base64,'
                                         '...")')
    if "base64" not in [p.strip().lower() for p in match.group(2).split(";")]:
        raise InvalidRequestError(param, 'must be base64-encoded ("data:image/png;base64,...")')
    try:
        return base64.b64decode(re.sub(r"\s+", "", match.group(3)), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(param, "is not valid base64") from None


def read_input(value: bytes | str, param: str) -> Any:
    """One input as a PIL image: a file's bytes, or a data: URL."""
    data = from_data_url(value, param) if isinstance(value, str) else value
    return decode_image(data, param)


__all__ = ["from_data_url", "read_input"]
