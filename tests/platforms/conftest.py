"""Fixtures for platform tests: a clean resolution state and fake vendor modules.

A fake device module imitates ``torch.<vendor>``: its ``Stream`` and ``Event``
form one family and refuse objects of any other family, so a backend that mixes
families fails loudly here, as the anchor's XPU path should have.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import threading
from types import ModuleType

import pytest

import diffrt.platforms as platforms


@pytest.fixture(autouse=True)
def clean_platform(monkeypatch: pytest.MonkeyPatch):
    """No override, no simdevice, no cached platform before and after each test."""
    monkeypatch.delenv("DIFFRT_PLATFORM", raising=False)
    monkeypatch.delenv("DIFFRT_SIMDEVICE", raising=False)
    platforms.reset_platform()
    yield
    platforms.reset_platform()


def make_device_module(family: str, available: bool = True, count: int = 2) -> ModuleType:
    """A fake ``torch.<family>`` recording calls in ``mod.calls``.

    Mirrors torch 2.13's ``torch/cuda/__init__.py`` and ``torch/cuda/streams.py``
    (which torch.xpu, torch_npu 2.13 and torch_musa copy): the current device is
    per thread and starts at 0 on a new thread (``set_device`` changes only the
    calling thread's), ``Stream(device=None, priority=0)`` lives on the given
    device or the creating thread's current one, ``current_stream(device=None)``
    builds a new object per call, and an event takes the device of the stream
    it is recorded on.
    """
    mod = ModuleType(f"fake_torch_{family}")
    calls: list[tuple] = []
    current = threading.local()  # like torch: the current stream and device are per thread

    def current_device() -> int:
        return getattr(current, "device", 0)

    class Stream:
        def __init__(self, device: int | None = None, priority: int = 0, *,
                     name: str = "side") -> None:
            self.name = name
            self.device = current_device() if device is None else int(device)

        def wait_event(self, event: object) -> None:
            if not isinstance(event, Event):
                raise TypeError(f"{family}.Stream.wait_event: foreign event {event!r}")
            calls.append(("wait_event", self.name, event))

        def synchronize(self) -> None:
            calls.append(("stream_synchronize", self.name))

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other.name == self.name

        def __hash__(self) -> int:
            return hash(self.name)

    class Event:
        def __init__(self, enable_timing: bool = False, blocking: bool = False,
                     interprocess: bool = False) -> None:
            self.recorded_on: str | None = None
            self.blocking = blocking
            self.done = False
            self.queries = 0
            #: queries answered False before the event completes by itself
            self.busy_queries = 0

        def record(self, stream: object = None) -> None:
            if not isinstance(stream, Stream):
                raise TypeError(f"{family}.Event.record: foreign stream {stream!r}")
            self.recorded_on = stream.name
            self.device = stream.device
            calls.append(("record", stream.name, self))

        def query(self) -> bool:
            self.queries += 1
            if not self.done and self.busy_queries and self.queries > self.busy_queries:
                self.done = True
            return self.done

        def synchronize(self) -> None:
            calls.append(("event_synchronize", self))
            self.done = True

    Stream.__qualname__ = Stream.__name__ = f"{family}Stream"
    Event.__qualname__ = Event.__name__ = f"{family}Event"
    def current_stream(device: int | None = None) -> Stream:
        calls.append(("current_stream", device))
        return Stream(device, name=getattr(current, "name", "default"))  # new per call

    def set_device(index: int) -> None:
        calls.append(("set_device", int(index)))
        current.device = int(index)

    @contextlib.contextmanager
    def stream(s: Stream):
        calls.append(("stream_enter", s.name))
        prev, current.name = getattr(current, "name", "default"), s.name
        prev_device, current.device = current_device(), s.device  # StreamContext switches too
        try:
            yield
        finally:
            current.name, current.device = prev, prev_device

    mod.Stream, mod.Event, mod.calls = Stream, Event, calls
    mod.current_stream, mod.stream = current_stream, stream
    mod.current_device, mod.set_device = current_device, set_device
    mod.is_available = lambda: available
    mod.device_count = lambda: count if available else 0
    mod.get_device_name = lambda i=0: f"Fake {family} {i}"
    mod.mem_get_info = lambda i=0: (1 << 20, 1 << 30)
    mod.synchronize = lambda device=None: calls.append(("synchronize",))
    return mod


@pytest.fixture
def device_module_factory():
    return make_device_module


@pytest.fixture
def fake_installed(monkeypatch: pytest.MonkeyPatch):
    """Pretend the named top-level packages are installed (find_spec finds them)."""
    real = importlib.util.find_spec
    installed: set[str] = set()

    def find_spec(name: str, package: str | None = None):
        if name in installed:
            return importlib.machinery.ModuleSpec(name, loader=None)
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return installed
