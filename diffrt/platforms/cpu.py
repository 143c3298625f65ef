"""Plain CPU: no events are needed, outputs are host memory when forward returns."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from diffrt.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    device_control_env_var = None
    # Packing may still run in the background thread: there is nothing to wait for.
    supports_async_output = True

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

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

