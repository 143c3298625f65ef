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
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch

from diffrt.platforms.interface import Platform, PlatformFeatureError


class TorchAcceleratorPlatform(Platform):
    """A platform backed by one ``torch.<vendor>`` device module."""

    supports_async_output = True

    def __init__(self) -> None:
        # Per thread: the stream set through stream_context (a stack), and the
        # cached default stream per device index. torch.<vendor>.current_stream()
        # builds a new Python object on every call; the runtime asks for it on
        # every forward, so we ask the vendor once per thread and device.
        self._tls = threading.local()

    # -- the one vendor module -----------------------------------------------------
    #: Attribute of ``torch`` holding the device module ("cuda", "npu", ...).
    module_attr: ClassVar[str] = ""
    #: Vendor package that registers ``torch.<module_attr>`` when imported, if any.
    vendor_package: ClassVar[str | None] = None

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

    def empty_cache(self) -> None:
        empty = getattr(self.device_module(), "empty_cache", None)
        if callable(empty):
            empty()

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
        index = mod.current_device()
        cache = getattr(self._tls, "default", None)
        if cache is None:
            cache = self._tls.default = {}
        stream = cache.get(index)
        if stream is None:
            stream = cache[index] = mod.current_stream(index)
        return stream

    def new_side_stream(self) -> Any:
        return self.device_module().Stream()

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
        event = self.device_module().Event()
        event.record(target)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream`` waits for ``event`` on the device; the host does not block."""
        target = self.current_stream() if stream is None else self._check(stream, "Stream")
        target.wait_event(self._check(event, "Event"))

    def event_query(self, event: Any) -> bool:
        return bool(self._check(event, "Event").query())

    def event_synchronize(self, event: Any) -> None:
        self._check(event, "Event").synchronize()

    # -- host memory ---------------------------------------------------------------
    def pinned_memory_available(self) -> bool:
        return self.is_available()
