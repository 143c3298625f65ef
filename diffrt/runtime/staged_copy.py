"""Device-to-host copies through page-locked staging buffers.

For platforms that can allocate page-locked memory but cannot page-lock the
output arena in place (XPU today; an NPU or MUSA build without the register
call): a copy straight into the arena would go to pageable memory, which the
driver stages through its own bounce buffer while the issuing thread waits.
Instead each output is copied asynchronously into a reused pinned buffer on
the output thread's side stream and, once that copy has landed, moved into its
arena slot with a host memcpy on the same thread — never on the main thread,
which is already launching the next forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from diffrt.platforms.pinned_pool import PinnedBufferPool, PinnedSlot
from diffrt.runtime.shm_transport import copy_host

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: pinned staging buffers kept (soft cap: a run with more outputs grows the pool)
MAX_STAGING_BUFFERS = 4


class StagedCopier:
    """Collects the copies of one run: ``copy`` enqueues each device → pinned
    copy, ``finish`` (after the side stream's copies completed) moves the
    bytes into their arena views, ``discard`` drops a failed run."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.pool = PinnedBufferPool(platform, max_buffers=MAX_STAGING_BUFFERS)
        self._pending: list[tuple[torch.Tensor, PinnedSlot]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        slot = self.pool.acquire(tuple(src.shape), src.dtype)
        self._pending.append((dst, slot))
        self.platform.copy_async(slot.tensor, src, stream)

    def finish(self) -> None:
        """Move every staged output into the arena; call only once the copies
        into the staging buffers are known to have landed."""
        pending, self._pending = self._pending, []
        try:
            for dst, slot in pending:
                copy_host(dst, slot.tensor)
        finally:
            for _, slot in pending:
                self.pool.release(slot)

    def discard(self) -> None:
        """Give the buffers of a failed run back; call only once the side
        stream is quiet (no copy can still land in them)."""
        pending, self._pending = self._pending, []
        for _, slot in pending:
            self.pool.release(slot)


__all__ = ["StagedCopier"]
