"""What ``diffrt env`` shows: the platform, why it was chosen, versions, capabilities.

Pure data; the CLI formats it. Package versions come from installed metadata,
so reporting never imports a vendor package. Capabilities are found by trying
them once on the chosen platform (which may initialise its device: this is the
one place we want to know for sure).
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform as _py_platform
from collections.abc import Callable
from typing import Any

import torch

from diffrt.platforms.interface import output_path
from diffrt.platforms.vendor_packages import SUPPORTED_TORCH, import_failures
from diffrt.vendor_metadata import VENDOR_PACKAGES

logger = logging.getLogger(__name__)

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _try(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:
        logger.debug("platform report: %s failed: %s", what, exc)
        return None, f"{type(exc).__name__}: {exc}"


def _capabilities(p: Any) -> dict[str, Any]:
    event, event_err = _try("record_device_event", p.record_device_event)
    stream, stream_err = _try("new_side_stream", p.new_side_stream)
    pinned, pinned_err = _try("pinned_memory_available", p.pinned_memory_available)
    return {
        "events": event is not None,
        "side_streams": stream is not None,
        "pinned_memory": bool(pinned),
        "async_output": bool(p.supports_async_output),
        "errors": {k: v for k, v in (("events", event_err), ("side_streams", stream_err),
                                     ("pinned_memory", pinned_err)) if v},
    }


def platform_report() -> dict[str, Any]:
    """Platform name, how it was chosen, versions, devices and capabilities.

    Returns:
        ``{"platform", "device_type", "dist_backend", "device_control_env_var",
        "class_path", "chosen_by", "reason", "versions": {...},
        "devices": {"count", "name"}, "capabilities": {"events", "side_streams",
        "pinned_memory", "async_output", "errors"}, "output_path", "supported_torch",
        "vendor_import_failures": {package: why}}``. Raises
        PlatformResolutionError when no platform can be chosen.
    """
    from diffrt.platforms import current_platform as p
    from diffrt.platforms import platform_choice

    choice = platform_choice()
    count, _ = _try("device_count", p.device_count)
    name, _ = _try("device_name", p.device_name) if count else (None, None)
    versions: dict[str, str | None] = {
        "python": _py_platform.python_version(),
        "diffrt": _version("diffrt"),
        "torch": torch.__version__,
        "torch.version.cuda": getattr(torch.version, "cuda", None),
        "torch.version.hip": getattr(torch.version, "hip", None),
        "torch.version.xpu": getattr(torch.version, "xpu", None),
    }
    versions.update({dist: v for dist in VENDOR_PACKAGES if (v := _version(dist))})
    return {
        "platform": p.name,
        "device_type": p.device_type,
        "dist_backend": p.dist_backend,
        "device_control_env_var": p.device_control_env_var,
        "device_control_env_vars": ",".join(p.visibility_vars()) or None,
        "class_path": choice.class_path,
        "chosen_by": choice.how,
        "reason": choice.reason,
        "versions": versions,
        "devices": {"count": count, "name": name},
        "capabilities": _capabilities(p),
        "output_path": output_path(p),
        "supported_torch": SUPPORTED_TORCH.get(p.name),
        "vendor_import_failures": import_failures(),
    }
