"""Importing torch once, when a command starts, so that a vendor backend that
fails inside ``import torch`` is named in one line instead of a traceback.

torch loads the ``torch.backends`` entry points of torch_npu and torch_musa
while it is imported; a build for another torch (or missing driver
libraries) then raises ``RuntimeError: Failed to load the backend
extension`` before any diffrt code runs, and torch cannot be imported again
in that process.
"""

from __future__ import annotations

import sys

from diffrt.vendor_metadata import AutoloadFailure, autoload_failure


def import_torch() -> AutoloadFailure | None:
    """Import torch; None when it imports (or already was), else what failed.
    Any other error propagates."""
    if "torch" in sys.modules:
        return None
    try:
        import torch  # noqa: F401
    except RuntimeError as exc:
        failure = autoload_failure(exc)
        if failure is None:
            raise
        return failure
    return None


__all__ = ["import_torch"]
