"""Vendor packages that are installed but cannot work here, and why.

A vendor package built for another torch fails at import (torch_musa has no
build for torch 2.13; torch-npu X.Y needs torch X.Y exactly). Detection treats
such a platform as inactive, which on its own would read "no accelerator
detected": this module keeps what went wrong, with the torch the package
declares it needs (``importlib.metadata.requires``) next to the torch that is
here, for the platform report, ``diffrt env``, start-up and ``/health``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading

import torch

from diffrt.vendor_metadata import torch_requirement

logger = logging.getLogger(__name__)

#: import name -> distribution name, for the packages a built-in platform imports
DISTRIBUTIONS = {"torch_npu": "torch-npu", "torch_musa": "torch_musa",
                 "intel_extension_for_pytorch": "intel-extension-for-pytorch"}

#: the torch each vendor stack supports, as declared in pyproject's extras and
#: the README ("unverified": a floor nobody has run diffrt on)
SUPPORTED_TORCH = {
    "cuda": ">=2.5 (tested: 2.13 CPU build only; 2.5 floor unverified)",
    "rocm": ">=2.5 (unverified)",
    "npu": "==2.13.* with torch-npu 2.13.* (torch-npu X.Y needs torch X.Y)",
    "xpu": ">=2.5 for one rank, >=2.8 for several (xccl); 2.5 floor unverified",
    "musa": "what torch_musa is built for (public builds: torch 2.7.1, 2.9); none for 2.13",
}

_lock = threading.Lock()
_failures: dict[str, str] = {}


def describe_failure(package: str, exc: BaseException) -> str:
    """One line: the package, its error, the torch it needs and the torch here."""
    dist = DISTRIBUTIONS.get(package, package)
    try:
        version = f" {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        version = ""
    needs = torch_requirement(dist)
    need = f"it requires {needs}, " if needs else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"{package}{version} is installed but cannot be imported "
            f"({type(exc).__name__}: {first}); {need}this is torch {torch.__version__}")


def try_import(package: str) -> str | None:
    """Import ``package``; None on success, else the one-line failure (kept
    for ``import_failures`` and logged once)."""
    try:
        importlib.import_module(package)
    except Exception as exc:  # a vendor build for another torch, missing CANN libraries...
        message = describe_failure(package, exc)
        record_failure(package, message)
        return message
    with _lock:
        _failures.pop(package, None)
    return None


def record_failure(package: str, message: str) -> None:
    """Keep why ``package`` (a vendor package, or a vendor call such as
    ``torch.xpu``) cannot work here, for the report; logged once."""
    with _lock:
        first = package not in _failures
        _failures[package] = message
    if first:
        logger.warning("%s", message)


def import_failures() -> dict[str, str]:
    """Vendor packages whose import failed or that were refused in this
    process, and vendor calls that failed (``torch.xpu``): name -> why."""
    with _lock:
        return dict(_failures)
