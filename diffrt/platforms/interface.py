"""The Platform interface: one device-generic surface over every vendor.

Identity lives in class attributes; device facts, streams, events and pinned
memory are methods. A backend overrides only what differs. Methods a backend
cannot provide raise ``PlatformFeatureError`` naming the vendor and the method
(never a silent None), except ``record_device_event``, whose None is the
documented "no usable events" answer that selects the synchronous copy path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)


def pin_rank(names: tuple[str, ...], rank: int, environ: Mapping[str, str],
             device_count: Callable[[], int]) -> dict[str, str]:
    """Pin ``rank`` through the innermost of the visibility variables ``names``
    that the caller set (its ids are the caller's), else through ``names[0]``
    over ``device_count()`` devices. Empty where there is nothing to pin."""
    if not names:
        return {}
    var = next((n for n in names if environ.get(n)), names[0])
    visible = environ.get(var)
    ids = [v for v in visible.split(",") if v.strip()] if visible else \
        [str(i) for i in range(device_count())]
    return {var: ids[rank % len(ids)].strip()} if ids else {}


class PlatformFeatureError(NotImplementedError):
    """A backend was asked for something it does not have."""

    def __init__(self, platform: str, method: str):
        super().__init__(f"platform {platform!r} does not provide {method}()")


class Platform:
    """Base class of all platforms.

    A backend sets the identity attributes below and overrides the methods its
    device provides; every other device method raises PlatformFeatureError.
    ``diffrt.platforms.current_platform`` is the one instance the runtime uses.
    """

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    #: the Ray resource that counts this platform's devices (None: CPU only)
    ray_resource: ClassVar[str | None] = None
    device_control_env_var: ClassVar[str | None] = None
    #: every variable that narrows the visible devices, innermost first: a
    #: worker is pinned through the first one the caller set (its indices are
    #: the caller's), else through ``device_control_env_var``. Empty: just that one.
    device_control_env_vars: ClassVar[tuple[str, ...]] = ()

    #: True where Ray's accelerator manager for ``ray_resource`` sets this
    #: platform's visibility variable in every actor (CUDA, ROCm, Ascend, Intel);
    #: False where diffrt must pin from ``ray.get_gpu_ids()`` itself (MUSA).
    ray_sets_visibility: ClassVar[bool] = True

    @classmethod
    def visibility_vars(cls) -> tuple[str, ...]:
        if cls.device_control_env_var and not cls.device_control_env_vars:
            return (cls.device_control_env_var,)
        return cls.device_control_env_vars

    @classmethod
    def rank_pinning_env(cls, rank: int, environ: Mapping[str, str],
                         device_count: Callable[[], int]) -> dict[str, str]:
        """The variables that pin worker ``rank`` to one device, as seen from a
        parent whose environment is ``environ`` (``pin_rank``). A vendor whose
        variables differ in syntax or number overrides it."""
        return pin_rank(cls.visibility_vars(), rank, environ, device_count)

    #: True when outputs may be copied off the device by a background thread.
    supports_async_output: ClassVar[bool] = False
    #: why weights stored as float8 e4m3 and cast to the compute dtype on the
    #: device at each call (``quantization="fp8-storage"``) cannot run here, in
    #: words for the config error; None where they can (a fact of the vendor's
    #: stack, like the identity attributes)
    fp8_storage_refusal: ClassVar[str | None] = None
    #: the "device" is host memory (CPU): nothing to offload to
    host_is_device: ClassVar[bool] = False

    # -- device facts ----------------------------------------------------------
    def is_available(self) -> bool:
        raise PlatformFeatureError(self.name, "is_available")

    def device_count(self) -> int:
        raise PlatformFeatureError(self.name, "device_count")

    def torch_device(self, index: int | None = None) -> torch.device:
        if index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def device_name(self, index: int = 0) -> str:
        raise PlatformFeatureError(self.name, "device_name")

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise PlatformFeatureError(self.name, "mem_get_info")

    def synchronize(self) -> None:
        raise PlatformFeatureError(self.name, "synchronize")

    def set_device(self, index: int) -> None:
        """Make device ``index`` this process's device (a rank's own device)."""
        raise PlatformFeatureError(self.name, "set_device")

    def bf16_supported(self) -> bool:
        """Whether the device computes in bfloat16 natively (not emulated). A
        platform that cannot tell answers False: the safe half type is float16."""
        return False

    def fp8_matmul_supported(self) -> bool:
        """Whether the device multiplies float8 matrices natively (what
        ``quantization="fp8"`` needs). A platform that cannot tell answers
        False, and the method is refused there."""
        return False

    def distributed_backend(self) -> str:
        """The ``torch.distributed`` backend name for several ranks, after
        loading whatever registers it; raises where this stack has none."""
        return self.dist_backend

    def empty_cache(self) -> None:
        """Give the caching allocator's unused device memory back (after an
        out-of-memory error). A platform without a device cache has nothing to
        give back: the default does nothing."""

    def trim_memory(self) -> None:
        """Return to the system the memory this process's allocator keeps for
        reuse (after a request far larger than the usual ones, so its peak is
        not held for good). A device: its caching allocator's unused blocks
        (``empty_cache``); the CPU platform: the C heap's free pages."""
        self.empty_cache()

    def held_memory_bytes(self) -> int | None:
        """The memory this process holds that ``trim_memory`` can shrink, in
        bytes: a device's caching-allocator reservation on the current device;
        the CPU platform's resident set. None where the platform cannot tell
        (callers then never trim for size)."""
        return None

    def varlen_attention(self, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        """The vendor's variable-length attention for ``dtype``, or None:
        ``f(q, k, v, starts, longest)`` with q/k/v (tokens, heads, dim), several
        sequences packed one after another, ``starts`` their int32 offsets
        (sequences + 1, from 0), ``longest`` the longest, each sequence
        attending to itself alone: softmax(q k^T / sqrt(dim)) v. Rows
        of several sizes in one padded call attend through it
        (``pipelines.segments.masked_attention``); None: SDPA with a mask."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new measure for ``peak_memory_bytes`` (before an execute)."""

    def peak_memory_bytes(self) -> int | None:
        """The most this process held, as ``held_memory_bytes`` counts it,
        since ``reset_peak_memory``: what one execute's activations took, the
        figure the engine calibrates its memory estimate from. None where the
        platform cannot tell."""
        return None

    def free_memory_bytes(self) -> int | None:
        """The memory this process could still take, in bytes: the host's
        available memory on CPU; on a device, what is free on it plus what its
        caching allocator holds unused. The engine's default batch memory
        budget is a share of it, read once the model is loaded and warm.
        None where the platform cannot tell."""
        return None

    # -- streams ---------------------------------------------------------------
    def current_stream(self) -> Any:
        raise PlatformFeatureError(self.name, "current_stream")

    def new_side_stream(self) -> Any:
        raise PlatformFeatureError(self.name, "new_side_stream")

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        raise PlatformFeatureError(self.name, "stream_context")

    # -- events (one family per backend) ----------------------------------------
    def record_device_event(self, stream: Any = None) -> Any | None:
        """Record an event on ``stream`` (default: current) or return None when
        the backend has no usable events (callers then copy synchronously)."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` without blocking the host."""
        raise PlatformFeatureError(self.name, "wait_event")

    def event_query(self, event: Any) -> bool:
        return bool(event.query())

    def event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def wait_for_compute(self, event: Any) -> None:
        """Make the work issued next on the current stream (the compute) wait
        for ``event`` — a host-to-device copy landing — without blocking the
        host where the device queues its work."""
        self.wait_event(self.current_stream(), event)

    def wait_copied(self, event: Any, stream: Any) -> None:
        """Block until the device-to-host copies enqueued on ``stream`` before
        ``event`` are in host memory (only then may a reader see the bytes).
        A backend whose event can complete before such a copy landed also
        synchronises ``stream``."""
        self.event_synchronize(event)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` (default: current) without
        waiting for it; the copy is complete only once an event recorded on
        that stream after this call has completed."""
        with self.stream_context(stream) if stream is not None else contextlib.nullcontext():
            dst.copy_(src, non_blocking=True)

    # -- host memory -------------------------------------------------------------
    def pinned_memory_available(self) -> bool:
        return False

    def register_host_memory(self, tensor: torch.Tensor) -> Any | None:
        """Page-lock existing host memory (the output arena) so a device-to-host
        copy into it is a real asynchronous DMA; returns a handle for
        ``unregister_host_memory``, or None where the platform cannot (copies
        into that memory are then staged by the driver and block the issuing
        thread on CUDA-like devices)."""
        return None

    def unregister_host_memory(self, handle: Any) -> None:
        """Undo ``register_host_memory`` (the memory stays valid)."""

    def can_register_host_memory(self) -> bool:
        """Whether this platform has a host-register call (without registering
        anything; a vendor backend looks up its runtime binding, which may
        initialise the vendor runtime in this process)."""
        return type(self).register_host_memory is not Platform.register_host_memory

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host buffer, or ordinary host memory where pinning is impossible."""
        if self.pinned_memory_available():
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as exc:  # e.g. host allocator refuses; degrade, say so once
                if not getattr(self, "_pin_warned", False):
                    self._pin_warned = True
                    logger.warning("%s: pinning host memory failed (%s); using pageable memory",
                                   self.name, exc)
        return torch.empty(shape, dtype=dtype)

    def __repr__(self) -> str:
        return f"<Platform {self.name} ({self.device_type})>"


def outputs_are_host_memory(platform: Platform) -> bool:
    """True where forward's outputs are already host memory (the CPU platform):
    no event is needed before reading them, nothing to page-lock."""
    return platform.name == "cpu"


def output_path(platform: Platform, registered: bool | None = None) -> str:
    """How outputs reach host memory on ``platform``: "host" (forward's outputs
    are host memory already), "page-locked" (the output arena is registered:
    asynchronous DMA into it), "staged" (pinned staging buffers, then a host
    memcpy into the arena) or "pageable" (neither: the driver stages each copy
    and the issuing thread waits). ``registered`` is whether registering the
    arena succeeded; None asks whether the platform can."""
    if outputs_are_host_memory(platform):
        return "host"
    if platform.can_register_host_memory() if registered is None else registered:
        return "page-locked"
    return "staged" if platform.pinned_memory_available() else "pageable"
