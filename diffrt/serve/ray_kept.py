"""What a Ray Serve model replica keeps of the last update it applied, until
the ingress settles it or has it rolled back (``ray_weights.py``).

The transformer's old values stay in the engine's ranks (``keep_previous``);
an adapter's old file(s) are copied here before the update replaces them,
into shared memory, so a roll-back registers them again under the old
version with their own LoRA metadata (alphas, ranks).
"""

from __future__ import annotations

import logging
import shutil

import msgspec

from diffrt.engine.weight_sync import Version, shared_dir
from diffrt.engine.weights.update import (
    WeightUpdateError,
    checksum,
    read_tensors,
    safetensors_files,
)

logger = logging.getLogger(__name__)


class Kept(msgspec.Struct, kw_only=True):
    """The last applied update's way back."""

    update: str
    lora: str | None
    version: Version
    #: what the update added to the replica's applied updates (it goes on a roll-back)
    key: tuple[str | None, str, str]
    #: an adapter's old file(s), copied; None with ``why_not`` when they could not be
    lora_copy: str | None = None
    why_not: str = ""


def copy_adapter(path: str, new_checksum: str) -> tuple[str | None, str]:
    """A copy of the adapter file(s) at ``path`` in shared memory, or (None,
    why) when its old factors cannot be kept: the file is gone, or it
    already holds the new factors (overwritten in place before the update)."""
    try:
        files = safetensors_files(path)
        old = read_tensors(path)
    except (OSError, WeightUpdateError) as exc:
        return None, f"its old file cannot be read ({exc})"
    if checksum(old) == new_checksum:
        return None, "its old file already holds the new factors (overwritten in place)"
    folder = shared_dir()
    for file in files:
        shutil.copy2(file, folder)
    return folder, ""


def drop_copy(folder: str | None) -> None:
    """Remove an adapter's copy (``copy_adapter``) no roll-back took."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["Kept", "copy_adapter", "drop_copy"]
