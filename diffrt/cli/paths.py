"""Checks on output paths, done before any model is loaded so a typo fails fast."""

from __future__ import annotations

import os
from pathlib import Path

from diffrt.cli.errors import CliError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
#: a video model's encoded clip (an image model refuses it: output_type "mp4")
VIDEO_SUFFIXES = (".mp4",)


def check_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Return ``path`` as a Path, or raise CliError saying why it cannot be written.

    The check opens the file for writing (and removes it again when it did not
    exist): permission bits say nothing for root, a read-only file system or
    a special folder, and an image computed for minutes must not be lost.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise CliError(f"cannot write {what} to {str(p)!r}: it is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"cannot write {what} to {str(p)!r}: folder {str(parent)!r} does not exist")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as exc:
        raise CliError(f"cannot write {what} to {str(p)!r}: {exc.strerror or exc}") from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def image_paths(output: str, num_prompts: int, per_prompt: int) -> list[list[Path]]:
    """Where each image goes: ``out.png`` for one image; with several prompts
    ``out-<i>.png`` (``i`` the prompt's index), and ``-<k>`` added per image with
    several images per prompt. Indexes, not prompt text: prompts may hold any
    character. Returns one list of paths per prompt, ``per_prompt`` long, every
    one checked by opening it."""
    base = check_writable_file(output, "images")
    if base.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise CliError(f"output {output!r} must end in one of "
                       f"{', '.join(IMAGE_SUFFIXES + VIDEO_SUFFIXES)}")
    if num_prompts == 1 and per_prompt == 1:
        return [[base]]
    paths = []
    for i in range(num_prompts):
        stem = f"{base.stem}-{i}" if num_prompts > 1 else base.stem
        if per_prompt == 1:
            paths.append([base.with_name(f"{stem}{base.suffix}")])
        else:
            paths.append([base.with_name(f"{stem}-{k}{base.suffix}") for k in range(per_prompt)])
    for group in paths:
        for path in group:
            check_writable_file(path, "images")
    return paths
