"""What installed vendor packages declare, read from their metadata alone.

Nothing here imports torch or a vendor package, so it still answers when
``import torch`` itself failed: torch_npu and torch_musa register
``torch.backends`` entry points (their setup.py: ``torch_npu =
torch_npu:_autoload``, ``torch_musa = torch_musa:_autoload``), which torch
loads inside ``import torch`` and turns any failure into ``RuntimeError:
Failed to load the backend extension: <name>`` (torch/__init__.py
``_import_device_backends``), before diffrt can run a line. The CLI catches
that error and names the package with this module, and so do the engine's
and the server's lazy imports (``import_naming_backend``) for a program that
imports diffrt; the platform layer uses it for the torch a package needs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

#: torch's entry-point group for out-of-tree device backends
BACKEND_GROUP = "torch.backends"
#: how torch's RuntimeError begins (torch/__init__.py ``_import_device_backends``)
AUTOLOAD_FAILED = "Failed to load the backend extension"
#: distributions whose versions ``diffrt env`` reports when installed
VENDOR_PACKAGES = (
    "torch-npu",
    "torch_musa",
    "intel-extension-for-pytorch",
    "pytorch-triton-xpu",
    "pytorch-triton-rocm",
    "nvidia-ml-py",
    "amdsmi",
)
#: the variable that stops torch from loading them
AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: distributions whose version is the torch they are built for (torch-npu
#: X.Y needs torch X.Y; torch_musa's version.txt is its torch's, 2.7.1), for
#: builds whose metadata declares no torch requirement (torch_musa's setup.py
#: requires only "packaging")
VERSION_FOLLOWS_TORCH = frozenset({"torch-npu", "torch_npu", "torch_musa", "torch-musa"})


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_requirement(dist: str) -> str | None:
    """The torch ``dist`` needs: the ``torch`` requirement of its metadata
    (e.g. "torch==2.7.1"), else, for a package whose version follows torch's,
    that torch's major.minor ("torch==2.13.*"); None when neither says."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        spec = line.split(";")[0].strip()
        if re.match(r"torch(?![\w.-])", spec):
            return spec.replace(" ", "")
    version = dist_version(dist)
    if version and dist in VERSION_FOLLOWS_TORCH:
        major_minor = ".".join(version.split("+")[0].split(".")[:2])
        return f"torch=={major_minor}.*"
    return None


@dataclass(frozen=True)
class AutoloadFailure:
    """A ``torch.backends`` entry point that failed inside ``import torch``."""

    #: the entry point's name ("torch_npu")
    entry_point: str
    #: the distribution that registered it ("torch-npu"), or None if not found
    dist: str | None
    version: str | None
    #: the torch it needs (``torch_requirement``)
    needs: str | None
    #: the installed torch (from metadata: torch could not be imported)
    torch: str | None
    #: the package's own error, first line, with its type
    error: str

    def line(self) -> str:
        """One line: the package, its version, its error, the torch it
        needs against the one here, and the way to start without it."""
        name = self.dist or self.entry_point
        version = f" {self.version}" if self.version else ""
        needs = f"it requires {self.needs}, " if self.needs else ""
        here = f"this is torch {self.torch}" if self.torch else "torch's version is unknown"
        return (f"import torch failed: torch could not load the {self.entry_point!r} backend "
                f"of {name}{version} ({self.error}); {needs}{here}. Install the {name} build "
                f"for this torch, or start without it: {AUTOLOAD_VAR}=0")

    def as_dict(self) -> dict[str, str | None]:
        return {"entry_point": self.entry_point, "package": self.dist, "version": self.version,
                "requires": self.needs, "torch": self.torch, "error": self.error,
                "fix": f"install the build for this torch, or {AUTOLOAD_VAR}=0"}


def _entry_point_dist(name: str) -> str | None:
    for ep in importlib.metadata.entry_points(group=BACKEND_GROUP):
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return getattr(dist, "name", None)
    return None


def autoload_failure(exc: BaseException) -> AutoloadFailure | None:
    """What torch's "Failed to load the backend extension" error is about,
    or None when ``exc`` is another error."""
    message = str(exc)
    if not isinstance(exc, RuntimeError) or AUTOLOAD_FAILED not in message:
        return None
    found = re.search(re.escape(AUTOLOAD_FAILED) + r":\s*([^\s.]+)", message)
    entry = found.group(1) if found else "?"
    dist = _entry_point_dist(entry)
    cause = exc.__cause__
    if cause is not None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        error = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    else:
        error = "no further error"
    return AutoloadFailure(entry, dist, dist_version(dist) if dist else None,
                           torch_requirement(dist) if dist else None, dist_version("torch"),
                           error)


class BackendAutoloadError(RuntimeError):
    """``import torch`` failed inside a vendor backend's entry point: what a
    program using the engine gets instead of torch's bare "Failed to load the
    backend extension" — the package, its version, the torch it needs and
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (``failure.line()``)."""

    def __init__(self, failure: AutoloadFailure) -> None:
        super().__init__(failure.line())
        self.failure = failure


#: the failure of this process's ``import torch``: torch cannot be imported
#: again after one (its extension modules stay half registered: a retry ends
#: in a segmentation fault), so a later import names the first failure
_failed: list[AutoloadFailure] = []


@contextlib.contextmanager
def naming_backend_failure() -> Iterator[None]:
    """Around imports that may be this process's first ``import torch``: a
    vendor backend failing inside it (now, or at an earlier try) raises
    BackendAutoloadError naming it. Other errors propagate."""
    if _failed:  # a second try would run torch's half-registered import again
        raise BackendAutoloadError(_failed[0])  # (it crashes): name the first failure
    try:
        yield
    except Exception as exc:
        failure = autoload_failure(exc)
        if failure is None:
            raise
        _failed.append(failure)
        raise BackendAutoloadError(failure) from exc


def import_naming_backend(module: str) -> ModuleType:
    """``importlib.import_module(module)`` under ``naming_backend_failure``."""
    with naming_backend_failure():
        return importlib.import_module(module)


__all__ = ["AUTOLOAD_VAR", "BACKEND_GROUP", "VENDOR_PACKAGES", "AutoloadFailure",
           "BackendAutoloadError", "autoload_failure", "dist_version", "import_naming_backend",
           "naming_backend_failure", "torch_requirement"]
