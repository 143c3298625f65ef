"""Encoding images for responses, and the store behind ``response_format="url"``."""

from __future__ import annotations

import base64
import io
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(image: Any, output_format: str, compression: int | None) -> bytes:
    """A PIL image as png/jpeg/webp bytes; ``compression`` is the jpeg/webp
    quality (OpenAI's ``output_compression``, default 100); png is lossless."""
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        quality = 100 if compression is None else compression
        image.save(buffer, format=output_format.upper(), quality=quality)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class ImageStore:
    """Images kept for ``/v1/images/{id}/content``: at most ``max_images`` and
    ``max_bytes``, each for ``ttl_s`` seconds (the oldest go first when full)."""

    def __init__(self, *, ttl_s: float, max_images: int, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_images = max_images
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()
        self._bytes = 0

    def put(self, data: bytes, media_type: str) -> str:
        image_id = uuid.uuid4().hex
        with self._lock:
            self._expire_locked()
            self._items[image_id] = (self._clock() + self.ttl_s, data, media_type)
            self._bytes += len(data)
            while len(self._items) > self.max_images or (
                    self._bytes > self.max_bytes and len(self._items) > 1):
                self._pop_oldest()
        return image_id

    def get(self, image_id: str) -> tuple[bytes, str] | None:
        with self._lock:
            self._expire_locked()
            item = self._items.get(image_id)
        return None if item is None else (item[1], item[2])

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._items)

    def _expire_locked(self) -> None:
        now = self._clock()
        while self._items and next(iter(self._items.values()))[0] <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, (_, data, _) = self._items.popitem(last=False)
        self._bytes -= len(data)
