"""The embedded models (`tiny-flux`, `tiny-sd3`): complete tiny diffusers
folders written on first use into the diffrt cache, then loaded exactly as a
user's checkpoint is (model_index.json, the folder's own text encoders and
tokenizers, the family's diffusers pipeline).

A folder is built by ``tiny_folders`` from fixed seeds, so the same library
versions give the same files on every machine. Its name carries a key of the
builder's arguments and the versions of the libraries that wrote it, so an
upgrade builds a fresh folder instead of reading one written under other
initialisation code.

Several processes may ask for the same folder at once (workers starting
together, two servers on one host): each builds into its own temporary folder
next to the final one and renames it into place; the first rename wins and the
others discard theirs, so a reader never sees a half-written folder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Bump when the builders change what they write.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class EmbeddedModel:
    """A tiny folder: which builder writes it, with which arguments."""

    builder: str  # a function of ``tiny_folders``
    kwargs: dict[str, Any] = field(default_factory=dict)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    # FLUX.1-dev-style: guidance-distilled, so guidance_scale is an input.
    "tiny-flux": EmbeddedModel("build_tiny_flux_folder",
                               {"seed": 20261129, "guidance_embeds": True}),
    # SD3 Medium-style: two CLIPs + T5, CFG with an (empty) negative prompt.
    "tiny-sd3": EmbeddedModel("build_tiny_sd3_folder", {"seed": 20261130}),
}

_VERSIONED = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")


def cache_dir() -> str:
    """``$DIFFRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/diffrt``, else ``~/.cache/diffrt``."""
    explicit = os.environ.get("DIFFRT_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffrt")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def folder_key(name: str) -> str:
    """12 hex digits naming what a folder was built from (no import of the libraries)."""
    model = EMBEDDED_MODELS[name]
    blob = json.dumps({"format": FORMAT_VERSION, "name": name, "builder": model.builder,
                       "kwargs": model.kwargs,
                       "versions": {d: _version(d) for d in _VERSIONED}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def embedded_folder(name: str) -> str:
    """The folder of embedded model ``name``, built first if this cache lacks it."""
    model = EMBEDDED_MODELS[name]
    root = os.path.join(cache_dir(), "models")
    final = os.path.join(root, f"{name}-{folder_key(name)}")
    if os.path.isfile(os.path.join(final, "model_index.json")):
        return final
    os.makedirs(root, exist_ok=True)
    from diffrt.engine.pipelines import tiny_folders
    from diffrt.engine.pipelines.loading import library_bars_off

    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        logger.info("writing embedded model %s to %s", name, final)
        with library_bars_off():
            getattr(tiny_folders, model.builder)(tmp, **model.kwargs)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model_index.json")):
                raise
            # Another process renamed its copy first: same bytes, keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
