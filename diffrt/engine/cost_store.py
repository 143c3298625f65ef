"""The step-cost model persisted, so a restart starts calibrated.

A model's coefficients hold for one device, one model's weights, one dtype
and the settings that change what a step costs (the rows' arrangement,
compilation, quantisation, offload, VAE tiling and its parallel decode,
parallel degrees, CPU threads). They are written, as JSON, to
``<cache dir>/step_cost/<key>.json`` (``store_folder``) where ``key`` hashes all of those
(``store_key``); the model folder is hashed by its files' names and sizes
and its JSON files' contents (weights are not read: cheap at every start).
A file that cannot be read or parsed is ignored (the engine calibrates as
if there were none) and a write that fails is logged, never raised: the
store is a speed-up, not state the engine needs.

Two models are kept per key: ``idle``, the fastest calibration measured
(``RunTimeModel.idle``: what cost limits and the token budget are judged
by, so they do not follow a momentary load), and ``latest``, the online
fit at the last save (the online model's prior at the next start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping

from diffrt.engine.models.folder_check import cache_dir

logger = logging.getLogger(__name__)

#: bump when the features change: an older file then describes other coefficients
FORMAT = 2


def folder_digest(folder: str | None) -> str:
    """A hash of a model folder's file names, sizes and JSON contents."""
    digest = hashlib.sha256()
    if folder is None or not os.path.isdir(folder):
        digest.update(str(folder).encode())
        return digest.hexdigest()[:16]
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            try:
                digest.update(f"{rel}:{os.path.getsize(path)}".encode())
                if name.endswith(".json"):
                    with open(path, "rb") as fh:
                        digest.update(fh.read())
            except OSError:
                continue
    return digest.hexdigest()[:16]


def store_key(device: str, folder: str | None, dtype: str,
              settings: Mapping[str, object]) -> str:
    """The file name's key for a model of these (see the module)."""
    what = json.dumps([FORMAT, device, folder_digest(folder), dtype,
                       sorted((k, repr(v)) for k, v in settings.items())])
    return hashlib.sha256(what.encode()).hexdigest()[:24]


def store_folder(root: str | None = None) -> str:
    """Where the models are written: ``<root>/step_cost``, else
    ``$DIFFRT_STEP_COST_DIR``, else ``<cache dir>/step_cost`` (a folder of
    its own lets a deployment keep it apart from the model cache; the tests
    give each test one, so no test is priced by another's runs)."""
    if root is not None:
        return os.path.join(root, "step_cost")
    return os.environ.get("DIFFRT_STEP_COST_DIR") or os.path.join(cache_dir(), "step_cost")


def store_path(key: str, root: str | None = None) -> str:
    return os.path.join(store_folder(root), f"{key}.json")


def load(key: str, root: str | None = None) -> dict[str, dict[str, float]]:
    """The persisted models by name (``idle``, ``latest``); {} when none."""
    path = store_path(key, root)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("step-cost model %s not read (%s): calibrating afresh", path, exc)
        return {}
    models: dict[str, dict[str, float]] = {}
    if isinstance(data, dict) and data.get("format") == FORMAT:
        for name in ("idle", "latest"):
            value = data.get(name)
            if isinstance(value, dict) and all(isinstance(v, int | float) for v in value.values()):
                models[name] = {k: float(v) for k, v in value.items()}
    return models


def save(key: str, models: Mapping[str, Mapping[str, float] | None],
         about: Mapping[str, object], root: str | None = None) -> None:
    """Write the models (atomically: a reader never sees half a file)."""
    path = store_path(key, root)
    data: dict[str, object] = {"format": FORMAT, **about}
    data.update({name: dict(value) for name, value in models.items() if value is not None})
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("step-cost model not saved to %s: %s", path, exc)


def persisted(root: str | None = None) -> list[dict[str, object]]:
    """Every persisted model in the cache (what ``diffrt env --check`` shows):
    its key, model name, coefficients and last recent prediction error."""
    folder = store_folder(root)
    found: list[dict[str, object]] = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return found
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append({"key": name[:-5], **{k: data.get(k) for k in
                                               ("model", "idle", "latest", "error")}})
    return found


__all__ = ["FORMAT", "folder_digest", "load", "persisted", "save", "store_folder", "store_key", "store_path"]
