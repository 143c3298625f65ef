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
and with what its recent work needed — the most it held during the executes
before each of its last ``TRIM_WINDOW`` checks — and trims
(``Platform.trim_memory``: ``malloc_trim(0)`` on CPU, the vendor's
``empty_cache`` on a device) when it holds more than the bound
``usual + max(TRIM_SLACK_BYTES, TRIM_SLACK_FRACTION x usual)``, ``usual`` the
larger of the two. Below the bound nothing is trimmed, so requests of the
usual sizes keep reusing their memory (a trim costs the next request its page
faults or device allocations: trimming after every batch of eight 256x256
requests cost a CPU worker 10-15 % of its throughput); a request far larger
than those before it is trimmed after at once, and the trimmed worker is back
near its baseline. What a process holds never falls without a trim (freed
memory stays with the allocator), so the recent peaks alone would keep a
high level for good once two large requests came close together: a worker
above ``trim_bound(baseline)`` that has not trimmed for ``TRIM_WINDOW``
checks trims anyway, and what it takes back after that is what its work
needs — one trim in ``TRIM_WINDOW`` checks of a busy worker.

The same bookkeeping measures what each execute took: the most the worker
held during it above the baseline (``Platform.peak_memory_bytes``: the
resident high-water mark on CPU, the allocator's peak reservation on a
device), which the engine's memory estimate is calibrated from
(``engine/memory_estimate.py``), and, once, the memory still free when the
baseline is taken, of which the default batch budget is a share.
"""

from __future__ import annotations

import logging
from collections import deque
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
#: the checks (executes that ended a request) whose peaks are the worker's
#: usual work: what they needed is kept for the requests after them
TRIM_WINDOW = 16


def trim_bound(baseline: int) -> int:
    """The most a worker whose warm baseline (or usual peak) is ``baseline``
    bytes holds after an execute without trimming."""
    return baseline + max(TRIM_SLACK_BYTES, int(TRIM_SLACK_FRACTION * baseline))


class MemoryTrimmer:
    """One worker's trim rule: call ``after_execute`` when an execute returned."""

    def __init__(self, platform: Platform):
        self.platform = platform
        #: bytes held after the first execute, trimmed; None until then
        self.baseline: int | None = None
        #: trims done for size (the first execute's is not counted)
        self.trims = 0
        #: what the platform said was free when the baseline was taken
        self.free_at_baseline: int | None = None
        #: the most held during the executes before each of the latest checks
        self._usual: deque[int] = deque(maxlen=TRIM_WINDOW)
        #: the most held during the executes since the last check
        self._peak_since_check = 0
        #: checks since the last trim
        self._untrimmed = 0

    def start_execute(self) -> None:
        """An execute begins: its peak is measured from here."""
        try:
            self.platform.reset_peak_memory()
        except Exception:
            logger.exception("resetting the memory peak failed")

    def peak_above_baseline(self) -> int | None:
        """The most held since ``start_execute`` above the warm baseline, in
        bytes (0 when the execute stayed within it); None before the baseline
        is taken or where the platform cannot tell."""
        if self.baseline is None:
            return None
        try:
            peak = self.platform.peak_memory_bytes()
        except Exception:
            logger.exception("reading the memory peak failed")
            return None
        if peak is None:
            return None
        self._peak_since_check = max(self._peak_since_check, peak)
        return max(0, peak - self.baseline)

    def after_execute(self) -> None:
        """Trim when the process holds more than ``trim_bound`` of the larger
        of its baseline and the peaks of its last ``TRIM_WINDOW`` checks (this
        one's own peak joins them after the decision), or more than
        ``trim_bound(baseline)`` with no trim for ``TRIM_WINDOW`` checks; the
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
                self.free_at_baseline = self.platform.free_memory_bytes()
                logger.info("warm memory baseline %d MiB (trimmed above %d MiB)",
                            self.baseline >> 20, trim_bound(self.baseline) >> 20)
                return
            usual = max(self._usual, default=self.baseline)
            self._usual.append(max(held, self._peak_since_check))
            self._peak_since_check = 0
            self._untrimmed += 1
            if held <= trim_bound(self.baseline) or (
                    held <= trim_bound(max(self.baseline, usual))
                    and self._untrimmed < TRIM_WINDOW):
                return
            self.platform.trim_memory()
            self._untrimmed = 0
            self.trims += 1
            after = self.platform.held_memory_bytes()
            logger.info("memory trimmed: %d MiB -> %s MiB (baseline %d MiB)", held >> 20,
                        "?" if after is None else after >> 20, self.baseline >> 20)
        except Exception:
            logger.exception("trimming memory failed")
