"""A simulated asynchronous device for tests.

Tensors are ordinary CPU tensors (device_type "cpu"), but work is asynchronous
the way a GPU's is: each ``SimStream`` runs its queued work, in order, on its
own background thread. ``copy_async`` enqueues a copy that lands only after a
delay (30 ms by default, env ``DIFFRT_SIMDEVICE_COPY_DELAY_MS``, plus the
bytes over ``DIFFRT_SIMDEVICE_COPY_GBPS`` when that is set, half that rate
into pageable memory), so a reader that
skips the wait sees stale bytes — a missing wait shows up as wrong data, not
as luck. Events complete only when the work queued before them has run.

As on CUDA, a copy into pageable memory blocks the thread that issued it. Two
switches take the page-locking abilities away, for the host paths a real
vendor may leave us with: ``DIFFRT_SIMDEVICE_HOST_REGISTER=0`` (no in-place
registration, like XPU: the output writer stages through pinned buffers) and
``DIFFRT_SIMDEVICE_PINNED=0`` (no pinned memory at all: pageable copies).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

DEFAULT_COPY_DELAY_S = 0.030


class SimEvent:
    """Completes when the stream it was recorded on reaches it."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def _complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class _StreamState:
    """What the worker thread shares with its stream (not the stream itself,
    so an unreferenced stream is collected and its thread ends)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.pending = 0  # jobs enqueued and not yet finished
        self.lock = threading.Lock()


def _worker(state: _StreamState) -> None:
    while True:
        job = state.queue.get()
        if job is None:
            return
        try:
            job()
        except BaseException as exc:  # a failing "kernel" must not stop the stream
            logger.error("simdevice kernel failed: %r", exc)
            if state.error is None:
                state.error = exc
        finally:
            job = None  # a finished job holds nothing (its tensors go with their owners)
            with state.lock:
                state.pending -= 1


class SimStream:
    """An in-order work queue run by one background thread."""

    _ids = itertools.count()

    def __init__(self, name: str = "") -> None:
        self.name = name or f"simstream-{next(self._ids)}"
        self._state = _StreamState()
        threading.Thread(target=_worker, args=(self._state,), name=self.name, daemon=True).start()
        weakref.finalize(self, self._state.queue.put, None)

    @property
    def error(self) -> BaseException | None:
        """The first exception raised by work on this stream, if any."""
        return self._state.error

    def enqueue(self, fn: Callable[[], Any]) -> None:
        with self._state.lock:
            self._state.pending += 1
        self._state.queue.put(fn)

    def record_event(self) -> SimEvent:
        """An event the stream completes when it reaches it: at once where
        nothing is queued (as a device's idle stream does; no thread hop)."""
        event = SimEvent()
        with self._state.lock:
            idle = self._state.pending == 0
        if idle:
            event._complete()
        else:
            self.enqueue(event._complete)
        return event

    def wait_event(self, event: SimEvent) -> None:
        """Work queued after this waits until ``event`` completed; the host
        does not (nothing to queue for an event already complete)."""
        if not isinstance(event, SimEvent):
            raise TypeError(f"SimStream.wait_event needs a SimEvent, got {type(event).__name__}")
        if not event.query():
            self.enqueue(event.synchronize)

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def query(self) -> bool:
        """True when all work queued so far has run."""
        return self._state.pending == 0

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"


class SimDevicePlatform(Platform):
    """Asynchronous streams and late copies over plain CPU tensors."""

    name = "simdevice"
    device_type = "cpu"
    dist_backend = "gloo"
    device_control_env_var = None
    supports_async_output = True

    def __init__(self, copy_delay_s: float | None = None, copy_gbps: float | None = None,
                 host_register: bool | None = None, pinned: bool | None = None) -> None:
        if copy_delay_s is None:
            ms = os.environ.get("DIFFRT_SIMDEVICE_COPY_DELAY_MS")
            copy_delay_s = float(ms) / 1000 if ms else DEFAULT_COPY_DELAY_S
        if copy_gbps is None and os.environ.get("DIFFRT_SIMDEVICE_COPY_GBPS"):
            copy_gbps = float(os.environ["DIFFRT_SIMDEVICE_COPY_GBPS"])
        if host_register is None:
            host_register = os.environ.get("DIFFRT_SIMDEVICE_HOST_REGISTER", "1") != "0"
        if pinned is None:
            pinned = os.environ.get("DIFFRT_SIMDEVICE_PINNED", "1") != "0"
        self.copy_delay_s = copy_delay_s
        self.copy_gbps = copy_gbps
        self.host_register = host_register
        self.pinned = pinned
        #: copies into pageable memory, each of which blocked its issuing thread
        self.blocking_copies = 0
        self._tls = threading.local()
        self._default = SimStream("simdevice-compute")
        #: page-locked ranges (start, end) of host memory (register_host_memory)
        self._registered: dict[int, tuple[int, int]] = {}
        self._next_handle = 0
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet([self._default])

    # -- device facts -------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int = 0) -> str:
        return f"simulated async device (copy delay {self.copy_delay_s * 1000:.0f} ms)"

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        return (1 << 30, 1 << 30)

    def synchronize(self) -> None:
        """Block until every stream has run its queued work; re-raise a failure."""
        for stream in list(self._streams):
            stream.synchronize()
        for stream in list(self._streams):
            if stream.error is not None:
                raise RuntimeError(f"work on {stream.name} failed") from stream.error

    # -- streams --------------------------------------------------------------------
    def _stream(self, stream: Any) -> SimStream:
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, SimStream):
            raise TypeError(f"simdevice uses SimStream only, got {type(stream).__name__}")
        return stream

    def current_stream(self) -> SimStream:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else self._default

    def new_side_stream(self) -> SimStream:
        stream = SimStream()
        self._streams.add(stream)
        return stream

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        stream = self._stream(stream)
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    # -- events -----------------------------------------------------------------------
    def record_device_event(self, stream: Any = None) -> SimEvent:
        return self._stream(stream).record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        self._stream(stream).wait_event(event)

    def event_query(self, event: Any) -> bool:
        return self._event(event).query()

    def event_synchronize(self, event: Any) -> None:
        self._event(event).synchronize()

    def wait_for_compute(self, event: Any) -> None:
        """This device's compute is the host thread itself (its tensors are
        CPU tensors, computed at once): the compute waits on the host."""
        self._event(event).synchronize()

    @staticmethod
    def _event(event: Any) -> SimEvent:
        if not isinstance(event, SimEvent):
            raise TypeError(f"simdevice uses SimEvent only, got {type(event).__name__}")
        return event

    # -- work -----------------------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """Enqueue ``dst.copy_(src)``; it lands ``copy_delay_s`` after the stream
        reaches it. As on CUDA, only a copy whose host side is page-locked
        (registered) is asynchronous — into it (device to host) or out of it
        (host to device; the "device" side here is never registered): with
        pageable memory the issuing thread waits until the copy has landed."""
        delay = self.copy_delay_s
        page_locked = self.is_page_locked(dst) or self.is_page_locked(src)
        if self.copy_gbps:
            # pageable copies go through the driver's bounce buffer: half the bandwidth
            gbps = self.copy_gbps if page_locked else self.copy_gbps / 2
            delay += src.numel() * src.element_size() / (gbps * 1e9)

        def copy() -> None:
            if delay:
                time.sleep(delay)
            dst.copy_(src)

        target = self._stream(stream)
        target.enqueue(copy)
        if not page_locked:
            self.blocking_copies += 1
            target.synchronize()

    # -- host memory: page-locking is simulated by address ranges ---------------------
    def _lock_range(self, tensor: torch.Tensor) -> int:
        start = tensor.data_ptr()
        self._next_handle += 1
        self._registered[self._next_handle] = (start, start + tensor.numel() * tensor.element_size())
        return self._next_handle

    def can_register_host_memory(self) -> bool:
        return self.host_register

    def register_host_memory(self, tensor: torch.Tensor) -> int | None:
        return self._lock_range(tensor) if self.host_register else None

    def unregister_host_memory(self, handle: Any) -> None:
        del self._registered[handle]

    def is_page_locked(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(lo <= start and end <= hi for lo, hi in self._registered.values())

    def launch(self, fn: Callable[[], Any], stream: Any = None, delay_s: float = 0.0) -> None:
        """Enqueue an arbitrary "kernel" (e.g. a fake forward writing its output late)."""
        if delay_s:
            def kernel() -> None:
                time.sleep(delay_s)
                fn()
        else:
            kernel = fn
        self._stream(stream).enqueue(kernel)

    # -- host memory ----------------------------------------------------------------
    def pinned_memory_available(self) -> bool:
        return self.pinned

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ordinary memory, registered: "pinned" for this device's copies
        (pageable without pinned memory)."""
        tensor = torch.empty(shape, dtype=dtype)
        if self.pinned:
            # unregistered with the tensor: a later pageable tensor at the same
            # address must not pass for page-locked
            weakref.finalize(tensor, self._registered.pop, self._lock_range(tensor), None)
        return tensor
