"""Checks on output paths, done before any model is loaded so a typo fails fast."""

from __future__ import annotations

import os
from pathlib import Path

from diffrt.cli.errors import CliError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def check_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Return ``path`` as a Path, or raise CliError saying why it cannot be written."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise CliError(f"cannot write {what} to {str(p)!r}: it is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"cannot write {what} to {str(p)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"cannot write {what} to {str(p)!r}: folder {str(parent)!r} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise CliError(f"cannot write {what} to {str(p)!r}: the file is not writable")
    return p


def image_paths(output: str, num_prompts: int, per_prompt: int) -> list[list[Path]]:
    """Where each image goes: ``out.png`` for one image, ``out-<prompt>[-<k>].png`` for more.

    Returns one list of paths per prompt, ``per_prompt`` long, every one checked.
    """
    base = check_writable_file(output, "images")
    if base.suffix.lower() not in IMAGE_SUFFIXES:
        raise CliError(f"output {output!r} must end in one of {', '.join(IMAGE_SUFFIXES)}")
    if num_prompts == 1 and per_prompt == 1:
        return [[base]]
    paths = []
    for i in range(num_prompts):
        stem = f"{base.stem}-{i}" if num_prompts > 1 else base.stem
        if per_prompt == 1:
            paths.append([base.with_name(f"{stem}{base.suffix}")])
        else:
            paths.append([base.with_name(f"{stem}-{k}{base.suffix}") for k in range(per_prompt)])
    return paths
