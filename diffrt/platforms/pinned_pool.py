"""A pool of page-locked host buffers for device-to-host copies.

Pinning is slow (``cudaHostAlloc`` takes a global lock) and a fresh buffer per
output costs far more than a warm copy, so buffers are kept and reused. A slot
handed back with the event of the copy that writes into it is reused only once
that event has completed: reusing it earlier would let the next copy overwrite
bytes a reader has not seen yet, or let an in-flight copy land in the next
owner's data. On CPU the platform records no event and ``empty_pinned`` gives
ordinary memory, so the pool degrades to plain reused buffers.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PinnedSlot:
    """One pooled buffer; ``tensor`` is a view of the requested shape and dtype."""

    tensor: torch.Tensor
    capacity: int
    _buffer: torch.Tensor = field(repr=False)
    _event: Any = field(default=None, repr=False)
    _in_use: bool = True


class PinnedBufferPool:
    """Reusable host buffers; a slot is reused only after its copy event completed.

    Args:
        platform: where events are queried and buffers pinned (default: current).
        max_buffers: soft cap on the number of buffers. At the cap a request
            waits for the oldest pending copy instead of allocating; buffers all
            held by callers are never waited for (the pool then grows and logs).
    """

    def __init__(self, platform: Platform | None = None, max_buffers: int | None = None):
        if platform is None:
            from diffrt.platforms import current_platform
            platform = current_platform
        self.platform: Platform = platform
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        self._slots: list[PinnedSlot] = []
        self._free: list[PinnedSlot] = []  # oldest release first
        self.allocations = 0
        self.reuses = 0

    # -- public -------------------------------------------------------------------
    def acquire(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> PinnedSlot:
        """A buffer of ``shape``/``dtype`` that no pending copy still writes to."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            slot = self._take_completed(nbytes)
            if slot is None and self._at_cap():
                slot = self._wait_for_pending(nbytes)
            if slot is None:
                slot = self._allocate(nbytes)
            else:
                self.reuses += 1
            slot._in_use = True
            slot._event = None
            slot.tensor = slot._buffer[:nbytes].view(dtype).view(tuple(shape))
            return slot

    def release(self, slot: PinnedSlot, event: Any = None) -> None:
        """Hand ``slot`` back; it is reused once ``event`` (may be None) completed.

        Pass the event recorded after the last copy into or out of the slot.
        """
        with self._lock:
            if not slot._in_use or slot not in self._slots:
                raise ValueError("slot released twice or not from this pool")
            slot._in_use = False
            slot._event = event
            self._free.append(slot)

    @property
    def total_bytes(self) -> int:
        return sum(s.capacity for s in self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    # -- internals ------------------------------------------------------------------
    def _done(self, slot: PinnedSlot) -> bool:
        return slot._event is None or self.platform.event_query(slot._event)

    def _take_completed(self, nbytes: int) -> PinnedSlot | None:
        fits = [s for s in self._free if s.capacity >= nbytes and self._done(s)]
        if not fits:
            return None
        best = min(fits, key=lambda s: s.capacity)
        self._free.remove(best)
        return best

    def _at_cap(self) -> bool:
        return self.max_buffers is not None and len(self._slots) >= self.max_buffers

    def _wait_for_pending(self, nbytes: int) -> PinnedSlot | None:
        """At the cap: wait for the oldest released slot; drop it if too small."""
        if not self._free:
            logger.debug("pinned pool: all %d buffers held, growing", len(self._slots))
            return None
        fits = [s for s in self._free if s.capacity >= nbytes]
        oldest = fits[0] if fits else self._free[0]
        self._free.remove(oldest)
        if oldest._event is not None:
            self.platform.event_synchronize(oldest._event)
            oldest._event = None
        if oldest.capacity >= nbytes:
            return oldest
        self._slots.remove(oldest)  # too small: replace it by a buffer that fits
        return None

    def _allocate(self, nbytes: int) -> PinnedSlot:
        buffer = self.platform.empty_pinned((max(nbytes, 1),), torch.uint8)
        slot = PinnedSlot(tensor=buffer, capacity=buffer.numel(), _buffer=buffer)
        self._slots.append(slot)
        self.allocations += 1
        return slot
