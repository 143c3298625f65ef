"""Encoding images for responses, and the store behind ``response_format="url"``."""

from __future__ import annotations

import base64
import io
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from diffrt.serve.settings import ServeSettings

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


def served_url(request: Any, route: str, **params: str) -> str:
    """The URL of a stored item's route (``route``: its name): under
    ``public_url`` when the server has one, else relative to this server
    (never built from the client's Host)."""
    path = request.scope.get("root_path", "") + request.app.url_path_for(route, **params)
    public = request.app.state.settings.public_url
    return f"{public.rstrip('/')}{path}" if public else path


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class StoreFull(Exception):
    """The store has no room for a request's images before some expire."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Reservation:
    """Room taken in an ``ImageStore`` at submission for one request's images,
    filled by ``put`` and given back by ``release`` (what was not filled).
    ``owner``: who may ``get`` what is put (None: anyone with the id)."""

    def __init__(self, store: ImageStore, count: int, bytes_each: int,
                 owner: str | None = None):
        self.store, self.count, self.bytes_each = store, count, bytes_each
        self.owner = owner

    def put(self, data: bytes, media_type: str) -> str:
        return self.store._fill(self, data, media_type)

    def release(self) -> None:
        self.store._release(self)


class ImageStore:
    """Images kept for ``/v1/images/{id}/content``: at most ``max_images`` and
    ``max_bytes``, each for ``ttl_s`` seconds.

    An unexpired image is never evicted: a request takes room for its images
    at submission (``reserve``: its count, and for each its estimated size),
    and one that does not fit is refused there (``StoreFull``, with the
    seconds until the oldest image expires); the room is filled with the
    encoded images (their real sizes replace the estimates) or given back.

    Items may have an owner (``reserve(owner=...)``): ``get`` with another
    one finds nothing (the rollout store's, ``rollout_store.py``; an image's
    owner is None, its random id the credential)."""

    def __init__(self, *, ttl_s: float, max_images: int,
                 max_bytes: int = ServeSettings().url_max_bytes,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_images = max_images
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        #: id -> (expiry, data, media type, owner)
        self._items: OrderedDict[str, tuple[float, bytes, str, str | None]] = OrderedDict()
        self._bytes = 0
        self._reserved_images = 0
        self._reserved_bytes = 0

    def reserve(self, count: int, bytes_each: int, owner: str | None = None) -> Reservation:
        """Room for ``count`` images of about ``bytes_each`` bytes; StoreFull
        while others hold the room, ValueError when even an empty store is
        too small (waiting would not help)."""
        if count > self.max_images or count * bytes_each > self.max_bytes:
            raise ValueError(self._too_large_message(count, bytes_each))
        with self._lock:
            self._expire_locked()
            images = len(self._items) + self._reserved_images + count
            size = self._bytes + self._reserved_bytes + count * bytes_each
            if images > self.max_images or size > self.max_bytes:
                raise StoreFull(self._full_message_locked(), self._retry_after_locked())
            self._reserved_images += count
            self._reserved_bytes += count * bytes_each
        return Reservation(self, count, bytes_each, owner)

    def _too_large_message(self, count: int, bytes_each: int) -> str:
        return (f"{count} images of about {bytes_each} bytes do not fit in the url image store "
                f"(at most {self.max_images} images, {self.max_bytes} bytes); use "
                'response_format="b64_json"')

    def _full_message_locked(self) -> str:
        return (f"the url image store is full ({len(self._items)} images, {self._bytes} bytes "
                f"kept, {self._reserved_images} being made; at most {self.max_images} images "
                f'and {self.max_bytes} bytes); retry later or use response_format="b64_json"')

    def _fill(self, reservation: Reservation, data: bytes, media_type: str) -> str:
        if reservation.count <= 0:
            raise RuntimeError("more images put than reserved")
        image_id = uuid.uuid4().hex
        with self._lock:
            reservation.count -= 1
            self._reserved_images -= 1
            self._reserved_bytes -= reservation.bytes_each
            self._items[image_id] = (self._clock() + self.ttl_s, data, media_type,
                                     reservation.owner)
            self._bytes += len(data)
        return image_id

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            self._reserved_images -= reservation.count
            self._reserved_bytes -= reservation.count * reservation.bytes_each
            reservation.count = 0

    def put(self, data: bytes, media_type: str) -> str:
        """Keep one image (a reservation of one, filled at once)."""
        return self.reserve(1, len(data)).put(data, media_type)

    def get(self, image_id: str, owner: str | None = None) -> tuple[bytes, str] | None:
        """An unexpired item's data and media type (None: unknown, expired,
        or another owner's)."""
        with self._lock:
            self._expire_locked()
            item = self._items.get(image_id)
        return None if item is None or item[3] != owner else (item[1], item[2])

    def delete(self, item_id: str, owner: str | None = None) -> bool:
        """Drop an item before it expires (False: none such of ``owner``'s)."""
        with self._lock:
            item = self._items.get(item_id)
            if item is None or item[3] != owner:
                return False
            del self._items[item_id]
            self._bytes -= len(item[1])
            return True

    def usage(self) -> dict[str, float]:
        """What /metrics shows: images and bytes kept and reserved, and the bounds."""
        with self._lock:
            self._expire_locked()
            return {"images": len(self._items), "bytes": self._bytes,
                    "reserved_images": self._reserved_images,
                    "reserved_bytes": self._reserved_bytes,
                    "max_images": self.max_images, "max_bytes": self.max_bytes,
                    "ttl_seconds": self.ttl_s}

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._items)

    def _retry_after_locked(self) -> int:
        """Whole seconds until the oldest image expires (at least 1)."""
        if not self._items:
            return max(1, math.ceil(self.ttl_s))
        expires = next(iter(self._items.values()))[0]
        return max(1, math.ceil(expires - self._clock()))

    def _expire_locked(self) -> None:
        now = self._clock()
        while self._items and next(iter(self._items.values()))[0] <= now:
            _, (_, data, _, _) = self._items.popitem(last=False)
            self._bytes -= len(data)
