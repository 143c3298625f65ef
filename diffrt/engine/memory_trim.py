"""When a worker gives memory its allocator keeps back to the system.

Allocators keep freed memory for reuse: a device's caching allocator its
blocks, and a CPU worker its heap (``cpu_policy.py`` sets glibc so on
purpose: page faults cost a quarter of a small request). The price is that
one large request's peak stays with the worker for good — one 512x512 n=10
request took a CPU worker from 444 MB to 3,410 MB resident, and a few such
workers on one host meet the kernel's OOM killer, which no request error
covers.

So after each execute the worker compares what it holds
(``Platform.held_memory_bytes``: the resident set on CPU, the allocator's
reservation on a device) with its *warm baseline* — what it held after its
first execute (the engine's warm-up request when warm-up is on), trimmed —
and trims (``Platform.trim_memory``: ``malloc_trim(0)`` on CPU, the vendor's
``empty_cache`` on a device) when it holds more than the bound
``baseline + max(TRIM_SLACK_BYTES, TRIM_SLACK_FRACTION x baseline)``. Below the
bound nothing is trimmed, so requests of the usual sizes keep reusing their
memory (a trim costs the next request its page faults or device
allocations); above it the trimmed worker is back near its baseline.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: memory a worker may hold above its warm baseline without a trim: at least
#: this many bytes (the scratch a usual request keeps on a tiny model) ...
TRIM_SLACK_BYTES = 256 << 20
#: ... or this fraction of the baseline, whichever is larger (a large model's
#: usual activations are a fraction of its weights)
TRIM_SLACK_FRACTION = 0.5


def trim_bound(baseline: int) -> int:
    """The most a worker whose warm baseline is ``baseline`` bytes holds
    after an execute without trimming."""
    return baseline + max(TRIM_SLACK_BYTES, int(TRIM_SLACK_FRACTION * baseline))


class MemoryTrimmer:
    """One worker's trim rule: call ``after_execute`` when an execute returned."""

    def __init__(self, platform: Platform):
        self.platform = platform
        #: bytes held after the first execute, trimmed; None until then
        self.baseline: int | None = None
        #: trims done for size (the first execute's is not counted)
        self.trims = 0

    def after_execute(self) -> None:
        """Trim when the process holds more than ``trim_bound(baseline)``; the
        first call trims unconditionally and takes the baseline. A platform
        that cannot tell what it holds is never trimmed. A failing trim is
        logged, never raised: the request it follows has its output."""
        try:
            held = self.platform.held_memory_bytes()
            if held is None:
                return
            if self.baseline is None:
                self.platform.trim_memory()
                self.baseline = self.platform.held_memory_bytes() or held
                logger.info("warm memory baseline %d MiB (trimmed above %d MiB)",
                            self.baseline >> 20, trim_bound(self.baseline) >> 20)
                return
            if held <= trim_bound(self.baseline):
                return
            self.platform.trim_memory()
            self.trims += 1
            after = self.platform.held_memory_bytes()
            logger.info("memory trimmed: %d MiB -> %s MiB (baseline %d MiB)", held >> 20,
                        "?" if after is None else after >> 20, self.baseline >> 20)
        except Exception:
            logger.exception("trimming memory failed")
