"""Shared body of every torch device backend (cuda, rocm, npu, xpu, musa).

Each vendor exposes the same module surface under ``torch.<vendor>``:
``Stream``, ``Event``, ``current_stream``, ``stream``, ``synchronize``,
``device_count``... A backend names its module once (``device_module``) and
this class uses ONLY that module's ``Stream``/``Event`` family. A vendor
``Event`` waited on from the generic ``torch.Stream`` (or the reverse) can be
silently ignored, as seen on XPU, so a stream or event of another family is
refused with a ``TypeError`` instead of being passed through.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch

from diffrt.platforms.interface import Platform, PlatformFeatureError

logger = logging.getLogger(__name__)

#: the longest sleep between two queries of an event that cannot block
POLL_MAX_S = 0.001


def poll_until(done: Any) -> None:
    """Wait for ``done()`` with sleeps that grow from 20 µs to ``POLL_MAX_S``:
    a waiting thread that cannot block on the device must not spin a core for
    the whole copy, and a short copy must not wait a whole millisecond."""
    pause = 20e-6
    while not done():
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


class TorchAcceleratorPlatform(Platform):
    """A platform backed by one ``torch.<vendor>`` device module."""

    supports_async_output = True

    def __init__(self) -> None:
        # Per thread: the stream set through stream_context (a stack), and the
        # cached default stream per device index. torch.<vendor>.current_stream()
        # builds a new Python object on every call; the runtime asks for it on
        # every forward, so we ask the vendor once per thread and device.
        self._tls = threading.local()
        #: the device ``set_device`` chose for this process (None: the vendor's
        #: current device of the calling thread, which is per thread)
        self._device_index: int | None = None

    # -- the one vendor module -----------------------------------------------------
    #: Attribute of ``torch`` holding the device module ("cuda", "npu", ...).
    module_attr: ClassVar[str] = ""
    #: Vendor package that registers ``torch.<module_attr>`` when imported, if any.
    vendor_package: ClassVar[str | None] = None
    #: keyword arguments of every ``Event`` this platform creates
    event_options: ClassVar[dict[str, Any]] = {}
    #: True where ``Event.synchronize()`` puts the waiting thread to sleep (CUDA's
    #: ``blocking=True`` events); elsewhere a host wait polls ``query()`` with
    #: growing sleeps instead of letting the vendor spin a core for the whole copy.
    event_sync_sleeps: ClassVar[bool] = False
    #: True where an event recorded after a device-to-host copy may complete
    #: before the bytes are in host memory; ``wait_copied`` then also
    #: synchronises the copy's stream.
    copy_event_may_precede_copy: ClassVar[bool] = False
    #: (runtime binding of the device module, register call, unregister call)
    #: for page-locking existing host memory, e.g. ``torch.cuda.cudart()
    #: .cudaHostRegister``; None where the vendor offers no such call.
    host_register_api: ClassVar[tuple[str, str, str] | None] = None
    #: flags passed to the register call
    host_register_flags: ClassVar[int] = 0

    def device_module(self) -> ModuleType:
        """The ``torch.<vendor>`` module. A vendor package is imported here, only
        once this platform was chosen: torch >= 2.5 autoloads out-of-tree backends
        through the ``torch.backends`` entry point, but older stacks (or
        ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) need the import."""
        mod = getattr(torch, self.module_attr, None)
        if mod is None and self.vendor_package:
            importlib.import_module(self.vendor_package)
            mod = getattr(torch, self.module_attr, None)
        if mod is None:
            raise PlatformFeatureError(self.name, f"torch.{self.module_attr}")
        return mod

    def _check(self, obj: Any, kind: str) -> Any:
        """Refuse a stream or event of another family (``kind``: "Stream"/"Event")."""
        mod = self.device_module()
        if not isinstance(obj, getattr(mod, kind)):
            raise TypeError(
                f"platform {self.name!r} uses torch.{self.module_attr}.{kind} only; "
                f"got {type(obj).__module__}.{type(obj).__qualname__}"
            )
        return obj

    # -- device facts -----------------------------------------------------------
    def is_available(self) -> bool:
        return bool(self.device_module().is_available())

    def device_count(self) -> int:
        return int(self.device_module().device_count())

    def device_name(self, index: int = 0) -> str:
        return str(self.device_module().get_device_name(index))

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        free, total = self.device_module().mem_get_info(index)
        return int(free), int(total)

    def synchronize(self) -> None:
        self.device_module().synchronize()

    def set_device(self, index: int) -> None:
        """Make device ``index`` this process's device: the vendor's current
        device of the calling thread, and the device of every stream this
        platform creates or caches from now on, on any thread. The vendor's
        current device is per thread (a new thread starts on device 0), so an
        output thread's side stream would otherwise land on device 0 while the
        rank computes on ``index``."""
        self.device_module().set_device(index)
        self._device_index = index
        self._tls = threading.local()  # cached default streams were of the old device

    def selected_device(self) -> int:
        """The device set with ``set_device``, else the calling thread's current one."""
        if self._device_index is not None:
            return self._device_index
        return int(self.device_module().current_device())

    def bf16_supported(self) -> bool:
        """Native bfloat16 only: torch.cuda's and torch.xpu's ``is_bf16_supported``
        default to ``including_emulation=True``, which is True on T4/V100 and Arc
        A-series, where bfloat16 is emulated and slow. Builds whose function takes
        no keyword (torch_npu, torch_musa) are asked plainly."""
        check = getattr(self.device_module(), "is_bf16_supported", None)
        if not callable(check):
            return False
        try:
            return bool(check(including_emulation=False))
        except TypeError:
            return bool(check())

    def empty_cache(self) -> None:
        empty = getattr(self.device_module(), "empty_cache", None)
        if callable(empty):
            empty()

    def held_memory_bytes(self) -> int | None:
        """``torch.<vendor>.memory_reserved`` of the selected device (what the
        caching allocator holds, used or cached); None where the vendor module
        has no such call."""
        reserved = getattr(self.device_module(), "memory_reserved", None)
        if not callable(reserved):
            return None
        return int(reserved(self.selected_device()))

    def reset_peak_memory(self) -> None:
        reset = getattr(self.device_module(), "reset_peak_memory_stats", None)
        if callable(reset):
            reset(self.selected_device())

    def peak_memory_bytes(self) -> int | None:
        """``torch.<vendor>.max_memory_reserved`` of the selected device since
        ``reset_peak_memory``; None where the vendor module has no such call."""
        peak = getattr(self.device_module(), "max_memory_reserved", None)
        if not callable(peak):
            return None
        return int(peak(self.selected_device()))

    def free_memory_bytes(self) -> int | None:
        """Free device memory (``mem_get_info``) plus the caching allocator's
        unused reservation (``memory_reserved - memory_allocated``); None where
        the vendor module lacks one of them."""
        mod, index = self.device_module(), self.selected_device()
        info = getattr(mod, "mem_get_info", None)
        reserved = getattr(mod, "memory_reserved", None)
        allocated = getattr(mod, "memory_allocated", None)
        if not (callable(info) and callable(reserved) and callable(allocated)):
            return None
        return int(info(index)[0]) + int(reserved(index)) - int(allocated(index))

    # -- streams ---------------------------------------------------------------
    def current_stream(self) -> Any:
        """The calling thread's current stream of this family.

        Cached per thread and device; streams must be switched through
        ``stream_context`` (which keeps the cache right), not through
        ``torch.<vendor>.stream`` directly.
        """
        stack = getattr(self._tls, "stack", None)
        if stack:
            return stack[-1]
        mod = self.device_module()
        index = self.selected_device()
        cache = getattr(self._tls, "default", None)
        if cache is None:
            cache = self._tls.default = {}
        stream = cache.get(index)
        if stream is None:
            stream = cache[index] = mod.current_stream(index)
        return stream

    def new_side_stream(self) -> Any:
        """A new stream on this process's device (``set_device``), whichever
        thread asks."""
        if self._device_index is None:
            return self.device_module().Stream()
        return self.device_module().Stream(device=self._device_index)

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current for the calling thread (vendor context too)."""
        if stream is None:
            yield
            return
        self._check(stream, "Stream")
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(stream)
        try:
            with self.device_module().stream(stream):
                yield
        finally:
            stack.pop()

    # -- events ------------------------------------------------------------------
    def record_device_event(self, stream: Any = None) -> Any | None:
        """Record a ``torch.<vendor>.Event`` on ``stream`` (default: current)."""
        target = self.current_stream() if stream is None else self._check(stream, "Stream")
        event = self.device_module().Event(**self.event_options)
        event.record(target)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream`` waits for ``event`` on the device; the host does not block."""
        target = self.current_stream() if stream is None else self._check(stream, "Stream")
        target.wait_event(self._check(event, "Event"))

    def event_query(self, event: Any) -> bool:
        return bool(self._check(event, "Event").query())

    def event_synchronize(self, event: Any) -> None:
        event = self._check(event, "Event")
        if self.event_sync_sleeps:
            event.synchronize()
        else:
            poll_until(event.query)

    def wait_copied(self, event: Any, stream: Any) -> None:
        self.event_synchronize(event)
        if self.copy_event_may_precede_copy:
            self._check(stream, "Stream").synchronize()

    # -- host memory ---------------------------------------------------------------
    def pinned_memory_available(self) -> bool:
        return self.is_available()

    def _host_register_calls(self) -> tuple[Any, Any] | None:
        """The vendor's (register, unregister) callables, or None when this
        platform or this vendor build has none."""
        if self.host_register_api is None:
            return None
        binding, register, unregister = self.host_register_api
        try:
            runtime = getattr(self.device_module(), binding)()
            return getattr(runtime, register), getattr(runtime, unregister)
        except Exception as exc:  # an older vendor build: the staging path
            logger.info("%s: no %s.%s() to page-lock host memory (%s)", self.name,
                        binding, register, exc)
            return None

    def can_register_host_memory(self) -> bool:
        return self._host_register_calls() is not None

    def _on_own_thread(self, call: Any, *args: Any) -> Any:
        """``call(*args)`` on a short-lived thread set to this process's device.

        torch's ``cudart().cudaHostRegister`` binding (and its hipified and
        MUSA twins) returns a failure code without clearing the runtime's
        per-thread last error (``C10_CUDA_ERROR_HANDLED``), so the next checked
        kernel launch on the calling thread would raise that unrelated error.
        The error dies with this thread instead. Returns the call's result;
        re-raises its exception."""
        index = self.selected_device()
        result: list[Any] = []

        def run() -> None:
            try:
                self.device_module().set_device(index)
                result.append((True, call(*args)))
            except BaseException as exc:  # handed to the caller below
                result.append((False, exc))

        thread = threading.Thread(target=run, name=f"diffrt-{self.name}-host-register")
        thread.start()
        thread.join()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def register_host_memory(self, tensor: torch.Tensor) -> Any | None:
        """Page-lock ``tensor``'s memory in place through the vendor runtime's
        host-register call. The calls return an error code instead of raising;
        anything but 0 means "not registered" (the caller then stages copies)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            return None
        calls = self._host_register_calls()
        if calls is None:
            return None
        register, unregister = calls
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        try:
            err = self._on_own_thread(register, ptr, nbytes, self.host_register_flags)
        except Exception as exc:
            logger.warning("%s: cannot page-lock host memory (%s)", self.name, exc)
            return None
        if err is not None and int(err) != 0:
            logger.warning("%s: page-locking %d bytes failed (error %s)", self.name, nbytes, err)
            return None
        # resident and locked from now on: it counts against a container's memory limit
        logger.info("%s: page-locked %.0f MiB of host memory (the output arena; bound it with "
                    "max_pending_output_bytes)", self.name, nbytes / (1 << 20))
        return (unregister, ptr)

    def unregister_host_memory(self, handle: Any) -> None:
        unregister, ptr = handle
        try:
            err = self._on_own_thread(unregister, ptr)
        except Exception as exc:
            logger.warning("%s: unregistering host memory failed: %s", self.name, exc)
            return
        if err is not None and int(err) != 0:
            logger.warning("%s: unregistering host memory failed (error %s)", self.name, err)
