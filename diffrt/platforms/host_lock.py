"""Page-locking host memory with ``mlock`` before a vendor registers it.

Ascend's ``aclrtHostRegisterV2`` raises for memory that is not already pinned
on Linux kernels up to 5.10 (openEuler 22.03 ships 5.10), and DeepSpeed's NPU
accelerator registers only memory it has locked first. Locking counts against
``RLIMIT_MEMLOCK`` (unless the process has CAP_IPC_LOCK), so a failure names
the limit. Only the standard library: ``ctypes`` on the C library already
loaded, ``resource``, ``platform``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import resource

PAGE = 4096


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running Linux kernel (``platform.release()``);
    (0, 0) where it cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", release if release is not None else platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def lock_pages(ptr: int, nbytes: int) -> str | None:
    """``mlock`` the range (faults every page in). Returns None when locked,
    else a one-line reason naming the limit."""
    libc = _libc()
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)) == 0:
        return None
    err = ctypes.get_errno()
    limit = memlock_limit()
    shown = "unlimited" if limit is None else f"{limit} bytes"
    return (f"mlock of {nbytes} bytes failed ({os.strerror(err)}; RLIMIT_MEMLOCK is {shown}: "
            "raise it, e.g. ulimit -l / docker --ulimit memlock=-1, or lower "
            "max_pending_output_bytes)")


def unlock_pages(ptr: int, nbytes: int) -> None:
    libc = _libc()
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))
