"""Test plugin: reading an adapter file whose path contains "slow-lora" waits
until the test lets it go (``release``; at most ``HOLD_LIMIT_S``), a seam for
"a slow load runs on the loader thread while requests keep stepping" that
does not race a fixed sleep against the steps; every other file reads as usual."""

from __future__ import annotations

import threading

from diffrt.engine.lora import adapter_file

#: the longest a held read waits for ``release`` (a test that fails midway
#: must not leave the loader thread blocked for ever)
HOLD_LIMIT_S = 120.0
#: set while a "slow-lora" read is held
reading = threading.Event()
_released = threading.Event()

_read = adapter_file.read_adapter


def release() -> None:
    """Let the held read (and any later one) go on."""
    _released.set()


def hold() -> None:
    """Hold the next "slow-lora" read until ``release``."""
    _released.clear()
    reading.clear()


def _slow_read(path, *args, **kwargs):
    if "slow-lora" in str(path):
        reading.set()
        _released.wait(HOLD_LIMIT_S)
    return _read(path, *args, **kwargs)


if getattr(adapter_file.read_adapter, "__name__", "") != "_slow_read":
    adapter_file.read_adapter = _slow_read
