"""Platform layer: `current_platform` is resolved lazily on first access."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffrt.platforms.interface import Platform, PlatformFeatureError

if TYPE_CHECKING:
    current_platform: Platform

__all__ = ["Platform", "PlatformFeatureError", "current_platform"]

_current: Platform | None = None


def _resolve() -> Platform:
    # Placeholder until detection lands: always CPU.
    from diffrt.platforms.cpu import CpuPlatform

    return CpuPlatform()


def __getattr__(name: str) -> Any:
    global _current
    if name == "current_platform":
        if _current is None:
            _current = _resolve()
        return _current
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
