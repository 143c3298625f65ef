"""Plain CPU: no events are needed, outputs are host memory when forward returns."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: where the kernel reports this process's sizes, in pages (Linux)
STATM = "/proc/self/statm"
STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


@functools.cache
def libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (it gives free pages of every malloc arena back to
    the kernel, whatever ``MALLOC_TRIM_THRESHOLD_`` says), or None where the C
    library has none (musl, macOS): there the CPU platform cannot trim, and
    freed memory stays with the process as its allocator decides."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        logger.debug("the C library has no malloc_trim: CPU memory is never trimmed")
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def resident_bytes(statm: str = STATM) -> int | None:
    """This process's resident set size (the second field of ``statm``, in
    pages); None where there is no such file (not Linux)."""
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_resident(clear_refs: str = CLEAR_REFS) -> None:
    """Reset the kernel's resident high-water mark of this process (``VmHWM``;
    writing 5 to ``clear_refs``, Linux 4.0+); nothing where it cannot."""
    try:
        with open(clear_refs, "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_resident_bytes(status: str = STATUS) -> int | None:
    """The resident high-water mark (``VmHWM`` of ``status``); None where there is none."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of the memory new work can take without swapping
    (``MemAvailable``); None where there is no such file (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    device_control_env_var = None
    # Packing may still run in the background thread: there is nothing to wait for.
    supports_async_output = True
    host_is_device = True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int = 0) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def synchronize(self) -> None:
        return None

    def current_stream(self) -> Any:
        return None

    def new_side_stream(self) -> Any:
        return None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record_device_event(self, stream: Any = None) -> Any | None:
        # Nothing to wait for on CPU; None keeps the contract "no event".
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def pinned_memory_available(self) -> bool:
        return False

    def trim_memory(self) -> None:
        """``malloc_trim(0)``: a CPU worker keeps freed heap memory for reuse
        (``engine/cpu_policy.py``), this gives its free pages back. A no-op
        where libc has no ``malloc_trim``."""
        trim = libc_malloc_trim()
        if trim is not None:
            trim(0)

    def held_memory_bytes(self) -> int | None:
        """The resident set (``/proc/self/statm``); None off Linux."""
        return resident_bytes()

    def reset_peak_memory(self) -> None:
        reset_peak_resident()

    def peak_memory_bytes(self) -> int | None:
        """The resident set's high-water mark since ``reset_peak_memory``
        (``VmHWM``); None off Linux."""
        return peak_resident_bytes()

    def free_memory_bytes(self) -> int | None:
        """The host's ``MemAvailable``; None off Linux."""
        return available_host_bytes()

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

