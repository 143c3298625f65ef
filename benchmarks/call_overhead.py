"""A fixed delay per transformer call: the per-call overhead knob of issue 50.

Standing in for a device's kernel launches, which a CPU does not have: on
import (as a ``plugin_modules`` entry, so it runs in diffrt's workers) it
wraps diffrt's Flux ``transformer_forward``, ``padded_forward`` and
``packed_forward`` at class level so each call — one per size with
``mixed_rows="by_size"``, one for every row with ``padded`` or ``packed`` —
first sleeps ``$DIFFRT_CALL_OVERHEAD_MS`` milliseconds (the outermost call
only). Benchmark code only: nothing in diffrt imports it.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

_DEPTH = threading.local()


def _delayed(method: Any, seconds: float) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0:
            time.sleep(seconds)
        _DEPTH.n = depth + 1
        try:
            return method(*args, **kwargs)
        finally:
            _DEPTH.n = depth
    return call


def install(milliseconds: float) -> None:
    from diffrt.engine.pipelines.flux.pipeline import FluxPipeline

    if milliseconds <= 0 or getattr(FluxPipeline, "_call_overhead_installed", False):
        return
    for name in ("transformer_forward", "padded_forward", "packed_forward"):
        setattr(FluxPipeline, name, _delayed(getattr(FluxPipeline, name), milliseconds / 1e3))
    FluxPipeline._call_overhead_installed = True  # type: ignore[attr-defined]


install(float(os.environ.get("DIFFRT_CALL_OVERHEAD_MS", "0") or 0))
