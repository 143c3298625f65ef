"""Platform layer: `current_platform` is resolved lazily on first access.

Resolution order (first level with an active candidate wins):

1. ``DIFFRT_PLATFORM=<name>``: a built-in name or an installed plugin's name;
2. out-of-tree entry points in the group ``diffrt.platform_plugins``;
3. built-in probes (cuda, rocm, npu, xpu, musa), which never initialise a device;
4. ``cpu``.

Two active candidates at one level is an error naming both. How the platform
was chosen is kept in ``platform_choice()`` for ``diffrt env``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from diffrt.platforms.detect import BUILTIN_CLASSES, BUILTIN_PROBES, missing_runtime
from diffrt.platforms.interface import Platform, PlatformFeatureError
from diffrt.platforms.vendor_packages import import_failures

if TYPE_CHECKING:
    current_platform: Platform

__all__ = [
    "ENV_VAR",
    "PLUGIN_GROUP",
    "Platform",
    "PlatformChoice",
    "PlatformFeatureError",
    "PlatformResolutionError",
    "current_platform",
    "known_platform_names",
    "load_platform_class",
    "platform_choice",
    "reset_platform",
    "resolve_platform",
    "set_current_platform",
]

logger = logging.getLogger(__name__)

ENV_VAR = "DIFFRT_PLATFORM"
PLUGIN_GROUP = "diffrt.platform_plugins"


class PlatformResolutionError(RuntimeError):
    """The platform cannot be chosen: unknown override, or two active candidates."""


@dataclass(frozen=True)
class PlatformChoice:
    """Which platform was chosen and why (shown by ``diffrt env``)."""

    name: str
    class_path: str
    #: "override", "plugin", "builtin", "fallback" or "explicit".
    how: str
    reason: str


_lock = threading.RLock()
_current: Platform | None = None
_choice: PlatformChoice | None = None


# -- entry points ---------------------------------------------------------------
def _is_builtin(ep: EntryPoint) -> bool:
    """Our own registrations (pyproject); an out-of-tree plugin may reuse a name."""
    return ep.name in BUILTIN_CLASSES and ep.value.replace(" ", "") == (
        f"diffrt.platforms.detect:detect_{ep.name}"
    )


def _plugin_entry_points() -> dict[str, EntryPoint]:
    """Out-of-tree entry points of the group, by name (built-ins excluded)."""
    plugins: dict[str, EntryPoint] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        if not _is_builtin(ep):
            plugins.setdefault(ep.name, ep)
    return plugins


def known_platform_names() -> list[str]:
    """Every name ``DIFFRT_PLATFORM`` accepts: built-ins and installed plugins."""
    return sorted(set(BUILTIN_CLASSES) | set(_plugin_entry_points()))


def _probe(name: str, detect: Callable[[], str | None]) -> str | None:
    """Run one detect callable; a failing or malformed one counts as inactive."""
    try:
        path = detect()
    except Exception as exc:
        logger.warning("platform probe %r failed, treated as inactive: %s", name, exc)
        return None
    if path is not None and not isinstance(path, str):
        logger.warning("platform probe %r returned %r, not a class path", name, path)
        return None
    return path


def _detector(ep: EntryPoint) -> Callable[[], str | None]:
    """The plugin's detect callable, loaded only when called (inside _probe's guard)."""
    return lambda: ep.load()()


def _one_of(level: str, active: dict[str, str]) -> tuple[str, str] | None:
    if len(active) > 1:
        found = ", ".join(f"{n} ({p})" for n, p in active.items())
        raise PlatformResolutionError(
            f"more than one {level} platform is active: {found}; "
            f"choose one with {ENV_VAR}=<name>"
        )
    return next(iter(active.items()), None)


# -- resolution -----------------------------------------------------------------
def resolve_platform() -> tuple[str, PlatformChoice]:
    """Decide which platform class to use, without instantiating or caching it.

    Returns (class path, choice). Raises PlatformResolutionError.
    """
    plugins = _plugin_entry_points()
    override = os.environ.get(ENV_VAR, "").strip()
    if override:
        key = override.lower()
        how, reason = "override", f"{ENV_VAR}={override}"
        if key in plugins:
            path = _probe(key, _detector(plugins[key]))
            if path is None:
                raise PlatformResolutionError(
                    f"{ENV_VAR}={override}: plugin {key!r} ({plugins[key].value}) is installed "
                    "but not active here (its detect callable returned None)"
                )
            return path, PlatformChoice(key, path, how, reason)
        if key in BUILTIN_CLASSES:
            missing = missing_runtime(key)
            if missing is not None:
                raise PlatformResolutionError(f"{ENV_VAR}={override}: {missing}")
            path = BUILTIN_CLASSES[key]
            return path, PlatformChoice(key, path, how, reason)
        raise PlatformResolutionError(
            f"{ENV_VAR}={override!r} names no known platform; "
            f"known: {', '.join(known_platform_names())}"
        )

    active = {n: p for n, ep in plugins.items() if (p := _probe(n, _detector(ep))) is not None}
    found = _one_of("plugin", active)
    if found:
        name, path = found
        return path, PlatformChoice(
            name, path, "plugin", f"entry point {name!r} ({plugins[name].value}) is active"
        )

    probed = [n for n in BUILTIN_PROBES if n != "cpu"]
    active = {n: p for n in probed if (p := _probe(n, BUILTIN_PROBES[n])) is not None}
    found = _one_of("built-in", active)
    if found:
        name, path = found
        return path, PlatformChoice(name, path, "builtin", f"probe detect_{name}() found it")

    path = BUILTIN_CLASSES["cpu"]
    reason = f"no accelerator detected (probed {', '.join(probed)})"
    broken = import_failures()
    if broken:  # not "nothing here": a vendor stack is installed but cannot work
        reason += "; " + "; ".join(broken.values())
    return path, PlatformChoice("cpu", path, "fallback", reason)


def load_platform_class(path: str) -> type[Platform]:
    """Import ``"pkg.module.Class"`` or ``"pkg.module:Class"`` and check it is a Platform."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PlatformResolutionError(f"malformed platform class path {path!r}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlatformResolutionError(f"cannot load platform class {path!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformResolutionError(f"{path!r} is not a diffrt Platform subclass")
    return cls


def _resolve() -> Platform:
    global _choice
    path, choice = resolve_platform()
    platform = load_platform_class(path)()
    _choice = choice
    log = logger.warning if import_failures() else logger.info
    log("platform %s chosen by %s: %s", platform.name, choice.how, choice.reason)
    return platform


def _get_current() -> Platform:
    global _current
    with _lock:
        if _current is None:
            _current = _resolve()
        return _current


def platform_choice() -> PlatformChoice:
    """How the current platform was chosen (resolving it first if needed)."""
    _get_current()
    assert _choice is not None
    return _choice


def set_current_platform(platform: Platform, reason: str = "set by the program") -> None:
    """Use ``platform`` from now on in this process (tests, embedding programs)."""
    global _current, _choice
    with _lock:
        _current = platform
        cls = type(platform)
        _choice = PlatformChoice(
            platform.name, f"{cls.__module__}.{cls.__qualname__}", "explicit", reason
        )


def reset_platform() -> None:
    """Forget the cached choice; the next access resolves again (for tests)."""
    global _current, _choice
    with _lock:
        _current = None
        _choice = None


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return _get_current()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
