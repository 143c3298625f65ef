"""Model name -> ModelSpec (the pipelines' ``load_pipeline`` loads one).

A model is one of:

- a local diffusers-format folder, whose family is read from its
  model_index.json (``_class_name``, or for an index without one its
  transformer class) among the registered families (entry points of group
  ``diffrt.model_families``, and `register_family`);
- a hub id ("owner/name") already in the local Hugging Face cache (resolved
  offline to its snapshot folder);
- a shipped model (`diffrt-shapes`, the default): a trained folder inside the
  package (``shipped.py``), treated as any folder;
- an embedded model (`tiny-flux`, `tiny-sd3`): a tiny folder of random weights
  written into the diffrt cache on first use (``embedded.py``) and then
  treated as any folder;
- a name added with `register_model` (a spec whose pipeline builds its own
  weights: ``DiffusionPipeline.load`` with no folder).

Resolving a model reads JSON only: it never loads weights and, once an
embedded folder exists, never imports diffusers, so the engine checks
requests at submission with ``resolve_model_spec(model).check(request)``.
"""

from __future__ import annotations

import logging
import os
import re
from functools import lru_cache
from importlib.metadata import entry_points

import msgspec

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.models.embedded import EMBEDDED_MODELS, embedded_folder
from diffrt.engine.models.family import Family, ModelFolder, load_object
from diffrt.engine.models.folder_check import (
    JsonObject,
    ModelLoadError,
    check_model_folder,
    read_json_object,
)
from diffrt.engine.models.shipped import SHIPPED_MODELS, shipped_folder

logger = logging.getLogger(__name__)

#: registered name -> spec (models without a folder)
_MODELS: dict[str, ModelSpec] = {}
#: The entry-point group families register under, each a "module:attribute"
#: naming its `Family`. The built-in ones (flux, sd3, qwen-image) are
#: registered there by diffrt's own package metadata, so an installed
#: out-of-tree family is their peer, and this room names no pipeline module.
FAMILY_GROUP = "diffrt.model_families"
#: family name -> Family, or the entry point's "module:attribute" until first use
_FAMILIES: dict[str, Family | str] = {}
_entry_points_read = False


def _registered() -> dict[str, Family | str]:
    """The registered families, the entry points' added on first use (a
    family registered by `register_family` before then keeps its place)."""
    global _entry_points_read
    if not _entry_points_read:
        for ep in entry_points(group=FAMILY_GROUP):
            _FAMILIES.setdefault(ep.name, ep.value)
        _entry_points_read = True
    return _FAMILIES


class UnknownModelError(ValueError):
    """The model is neither a registered name nor a loadable local folder."""

    def __init__(self, model: str, reason: str = ""):
        known = ", ".join(known_models())
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"model: unknown model {model!r}{detail}; known models: {known}, "
            "a path to a local diffusers-format folder of a registered family "
            f"({', '.join(sorted(_registered()))}), or a hub id already in the local Hugging Face "
            "cache"
        )
        self.model = model


def register_family(family: Family) -> None:
    """Serve the folders ``family`` describes (a plugin's, or a replacement of
    a built-in one under the same name). Folders already resolved keep the
    spec they were given."""
    if family.name in _registered():
        logger.warning("re-registering family %r", family.name)
    _FAMILIES[family.name] = family
    _folder_spec.cache_clear()


def register_model(spec: ModelSpec) -> None:
    """Make ``spec.name`` a model whose pipeline (``spec.pipeline``) builds its
    own weights (``spec.folder`` None) or loads them from ``spec.folder``."""
    if spec.name in _MODELS:
        logger.warning("re-registering model %r", spec.name)
    _MODELS[spec.name] = spec


def unregister_model(name: str) -> None:
    _MODELS.pop(name, None)


def known_models() -> list[str]:
    """The shipped, embedded and registered model names, sorted."""
    return sorted({*SHIPPED_MODELS, *EMBEDDED_MODELS, *_MODELS})


def families() -> list[Family]:
    """The registered families (built-in ones imported on first use)."""
    out = []
    for name, entry in list(_registered().items()):
        family = load_object(entry) if isinstance(entry, str) else entry
        _FAMILIES[name] = family
        out.append(family)
    return out


def _family_of(folder: str, index_path: str, index: JsonObject) -> Family:
    """The family of a folder: by the pipeline class its index names, else (an
    index without ``_class_name``) by its transformer class. A folder naming a
    pipeline class no family serves is refused: an editing model shares its
    transformer class with a text-to-image family and must not be run as one."""
    pipeline_class = index.get("_class_name")
    if isinstance(pipeline_class, str):
        family = next((f for f in families() if pipeline_class in f.diffusers_pipelines), None)
        if family is None:
            check_model_folder(folder)  # a class diffusers does not know is named as such
            served = sorted(p for f in families() for p in f.diffusers_pipelines)
            raise UnknownModelError(os.path.dirname(index_path), (
                f"unsupported pipeline class {pipeline_class} in model_index.json; "
                f"served: {', '.join(served)}"))
        return family
    entry = index.get("transformer")
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        raise ModelLoadError(f"{index_path}: names no pipeline class (_class_name) and no "
                             'transformer (expected "transformer": ["diffusers", "<class name>"])')
    family = next((f for f in families() if entry[1] in f.transformer_classes), None)
    if family is None:
        raise UnknownModelError(os.path.dirname(index_path), f"unsupported transformer {entry[1]}")
    return family


@lru_cache(maxsize=64)
def _folder_spec(folder: str, name: str | None = None) -> ModelSpec:
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise UnknownModelError(folder, "not a diffusers pipeline folder: no model_index.json")
    family = _family_of(folder, index_path, read_json_object(index_path))
    # every component whole, before any worker loads it
    index = check_model_folder(folder, diffusers_pipeline=family.diffusers)
    describe = load_object(family.describe) if isinstance(family.describe, str) else family.describe
    spec = describe(ModelFolder.read(folder, name or folder, index))
    named = (SHIPPED_MODELS.get(name) or EMBEDDED_MODELS.get(name)) if name else None
    if named is not None:  # what the named model was built or trained for
        defaults = msgspec.structs.replace(spec.defaults, **named.sampling_defaults)
        cache = msgspec.structs.replace(spec.cache, **named.cache)
        spec = msgspec.structs.replace(
            spec, defaults=defaults, cache=cache,
            default_negative_prompt=getattr(named, "default_negative_prompt", None),
            **named.spec_overrides)
    return spec


def resolve_model_spec(model: str) -> ModelSpec:
    """The spec of ``model``, without loading weights.

    Raises:
        UnknownModelError: neither a registered name nor a usable local folder.
        ModelLoadError: a folder with a broken file (named).
    """
    if not isinstance(model, str) or not model:
        raise UnknownModelError(repr(model), "must be a non-empty str")
    if model in _MODELS:
        return _MODELS[model]
    if model in SHIPPED_MODELS:
        return _folder_spec(shipped_folder(model), model)
    if model in EMBEDDED_MODELS:
        return _folder_spec(embedded_folder(model), model)
    if os.path.isdir(model):
        folder = os.path.realpath(model)
        return _folder_spec(folder, _shipped_name(folder))
    if _HUB_ID.fullmatch(model):
        return _folder_spec(os.path.realpath(cached_snapshot(model)))
    raise UnknownModelError(model)


def _shipped_name(folder: str) -> str | None:
    """The shipped model whose folder this is (given by path, it keeps the
    defaults it was trained for), else None."""
    return next((name for name in SHIPPED_MODELS
                 if os.path.realpath(shipped_folder(name)) == folder), None)


#: "owner/name" as the Hugging Face hub names a repository.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def cached_snapshot(repo_id: str) -> str:
    """The folder of ``repo_id`` already in the local Hugging Face cache,
    resolved offline: nothing is downloaded. Raises UnknownModelError naming
    the cache folder it looked in."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        cache = os.environ.get("HF_HUB_CACHE", constants.HF_HUB_CACHE)
        raise UnknownModelError(
            repo_id, f"not a registered model or a folder, and not in the local Hugging Face "
                     f"cache {cache} ({type(exc).__name__}); nothing is downloaded: fetch it "
                     f"first, e.g. `huggingface-cli download {repo_id}`") from None
