"""Test plugin: reading an adapter file whose path contains "slow-lora" takes
``SLOW_S`` seconds (a seam for "a slow load runs on the loader thread while
requests keep stepping"); every other file reads as usual."""

from __future__ import annotations

import time

from diffrt.engine.lora import adapter_file

SLOW_S = 3.0

_read = adapter_file.read_adapter


def _slow_read(path, *args, **kwargs):
    if "slow-lora" in str(path):
        time.sleep(SLOW_S)
    return _read(path, *args, **kwargs)


if getattr(adapter_file.read_adapter, "__name__", "") != "_slow_read":
    adapter_file.read_adapter = _slow_read
