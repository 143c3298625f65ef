"""Model name -> pipeline class, and loading.

A model is one of:

- a local diffusers-format folder, whose family is read from its
  model_index.json and mapped through the families registered with
  `register_family`;
- a hub id ("owner/name") already in the local Hugging Face cache (resolved
  offline to its snapshot folder);
- a shipped model (`diffrt-shapes`, the default): a trained folder inside the
  package (``shipped.py``), treated as any folder;
- an embedded model (`tiny-flux`, `tiny-sd3`): a tiny folder of random weights
  written into the diffrt cache on first use (``embedded.py``) and then
  treated as any folder;
- a name added with `register_pipeline` (a class with its own `create`).

Resolving a model never loads weights and, once an embedded folder exists,
never imports diffusers, so the engine can validate requests at submission
with ``resolve_pipeline_class(model).check_inputs(request)``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from diffrt.engine.pipelines.embedded import EMBEDDED_MODELS, embedded_folder
from diffrt.engine.pipelines.folder_check import (
    ModelLoadError,
    check_model_folder,
    read_json_object,
)
from diffrt.engine.pipelines.interface import DiffusionPipeline
from diffrt.engine.pipelines.shipped import SHIPPED_MODELS, shipped_folder
from diffrt.engine.request import DiffusionRequest

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")

#: name -> class, or "module:Class" imported on first use.
_PIPELINES: dict[str, type[DiffusionPipeline] | str] = {}
#: diffusers transformer class name -> family class (for local folders).
_FAMILIES: dict[str, type[DiffusionPipeline] | str] = {
    "FluxTransformer2DModel": "diffrt.engine.pipelines.flux:FluxPipeline",
    "SD3Transformer2DModel": "diffrt.engine.pipelines.sd3:SD3Pipeline",
    "QwenImageTransformer2DModel": "diffrt.engine.pipelines.qwen_image:QwenImagePipeline",
}


class UnknownModelError(ValueError):
    """The model is neither a registered name nor a loadable local folder."""

    def __init__(self, model: str, reason: str = ""):
        known = ", ".join(known_models())
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"model: unknown model {model!r}{detail}; known models: {known}, "
            "a path to a local diffusers-format Flux/SD3/Qwen-Image folder, or a hub id already in the "
            "local Hugging Face cache"
        )
        self.model = model


def _load_class(entry: type[DiffusionPipeline] | str) -> type[DiffusionPipeline]:
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        return getattr(importlib.import_module(module), name)
    return entry


def register_pipeline(name: str, cls: type[DiffusionPipeline] | str) -> None:
    """Make `name` a model: `cls` (or "module:Class") must implement `create`."""
    if name in _PIPELINES:
        logger.warning("re-registering pipeline %r", name)
    _PIPELINES[name] = cls


def register_family(transformer_class: str, cls: type[DiffusionPipeline] | str) -> None:
    """Map a diffusers transformer class name to the pipeline that loads it
    from a local folder (through `cls.from_pretrained`)."""
    _FAMILIES[transformer_class] = cls


def known_models() -> list[str]:
    """The shipped, embedded and registered model names, sorted."""
    return sorted({*SHIPPED_MODELS, *EMBEDDED_MODELS, *_PIPELINES})


@lru_cache(maxsize=64)
def _local_pipeline_class(folder: str, name: str | None = None) -> type[DiffusionPipeline]:
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise UnknownModelError(folder, "not a diffusers pipeline folder: no model_index.json")
    entry = read_json_object(index_path).get("transformer")
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        raise ModelLoadError(f"{index_path}: names no transformer (expected "
                             '"transformer": ["diffusers", "<class name>"])')
    family_name = entry[1]
    if family_name not in _FAMILIES:
        raise UnknownModelError(folder, f"unsupported transformer {family_name}")
    index = check_model_folder(folder)  # every component whole, before any worker loads it
    encoder = index.get("text_encoder")
    if not (isinstance(encoder, list) and len(encoder) == 2 and encoder[0] is not None):
        raise ModelLoadError(f"{index_path}: lists no text_encoder (diffrt conditions images "
                             "on the prompt with the folder's own text encoders)")
    family = _load_class(_FAMILIES[family_name])
    attrs: dict[str, Any] = {"pretrained_path": folder, "name": name or folder}
    from_config = getattr(family, "attrs_from_config", None)
    if from_config is not None:
        tcfg = os.path.join(folder, "transformer", "config.json")
        vcfg = os.path.join(folder, "vae", "config.json")
        attrs.update(from_config(read_json_object(tcfg) if os.path.isfile(tcfg) else {},
                                 read_json_object(vcfg) if os.path.isfile(vcfg) else {}))
    named = SHIPPED_MODELS.get(name) or EMBEDDED_MODELS.get(name)
    if named is not None:  # what the named model was built or trained for
        attrs["sampling_defaults"] = {**attrs.get("sampling_defaults", family.sampling_defaults),
                                      **named.sampling_defaults}
        attrs["default_negative_prompt"] = getattr(named, "default_negative_prompt", None)
    # A per-folder subclass: check_inputs (a classmethod) sees the folder's limits.
    return type(family.__name__, (family,), attrs)


def resolve_pipeline_class(model: str) -> type[DiffusionPipeline]:
    """The pipeline class for `model`, without loading weights.

    Raises:
        UnknownModelError: neither a registered name nor a usable local folder.
    """
    if not isinstance(model, str) or not model:
        raise UnknownModelError(repr(model), "must be a non-empty str")
    if model in _PIPELINES:
        return _load_class(_PIPELINES[model])
    if model in SHIPPED_MODELS:
        return _local_pipeline_class(shipped_folder(model), model)
    if model in EMBEDDED_MODELS:
        return _local_pipeline_class(embedded_folder(model), model)
    if os.path.isdir(model):
        folder = os.path.realpath(model)
        return _local_pipeline_class(folder, _shipped_name(folder))
    if _HUB_ID.fullmatch(model):
        return _local_pipeline_class(os.path.realpath(cached_snapshot(model)))
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


def load_pipeline(
    model: str,
    *,
    device: torch.device | str = CPU,
    dtype: torch.dtype = torch.float32,
) -> DiffusionPipeline:
    """Load the pipeline for `model` onto `device`."""
    cls = resolve_pipeline_class(model)
    try:
        pipeline = cls.create(device=torch.device(device), dtype=dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # one line for the user; the traceback stays in the log
        logger.debug("loading %s failed", model, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(f"{model}: cannot load ({type(exc).__name__}: {first})") from exc
    logger.info("loaded pipeline %s on %s (%s)", model, device, dtype)
    return pipeline


def get_pre_process_func(model: str) -> Callable[[DiffusionRequest], DiffusionRequest]:
    """Engine-side hook run on a request before it is submitted to a worker."""
    return resolve_pipeline_class(model).pre_process


def get_post_process_func(
    model: str,
) -> Callable[[torch.Tensor, str], tuple[list[Any] | None, Any]]:
    """Engine-side hook turning a host tensor into (images, output); the
    default is `diffrt.engine.postprocess.postprocess_output`."""
    return resolve_pipeline_class(model).post_process
