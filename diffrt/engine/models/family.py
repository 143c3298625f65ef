"""What a model family registers, and what its spec is built from.

A family is one ``Family`` entry: the diffusers pipeline classes its folders
name in ``model_index.json`` (``_class_name``), the transformer classes that
identify an older folder without one, and ``describe``: a function that reads
a folder's configs (``ModelFolder``, JSON only: no weights, no diffusers) and
returns the folder's ``ModelSpec``. ``register_family`` (``registry.py``) is
the one hook, for the built-in families and plugins alike.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.models.folder_check import JsonObject, read_json_object


@dataclass(frozen=True)
class ModelFolder:
    """A diffusers folder's configs, as a family's ``describe`` reads them."""

    path: str
    #: the name the engine serves it under (a shipped or embedded name, else the path)
    name: str
    index: JsonObject
    transformer_config: JsonObject = field(default_factory=dict)
    vae_config: JsonObject = field(default_factory=dict)

    @classmethod
    def read(cls, path: str, name: str, index: JsonObject) -> ModelFolder:
        return cls(path, name, index, _config(path, "transformer"), _config(path, "vae"))


def _config(folder: str, component: str) -> JsonObject:
    path = os.path.join(folder, component, "config.json")
    return read_json_object(path) if os.path.isfile(path) else {}


@dataclass(frozen=True)
class Family:
    """One model family; see the module docstring."""

    name: str
    #: ``model_index.json`` ``_class_name`` values whose folders it serves
    diffusers_pipelines: tuple[str, ...]
    #: transformer classes that identify a folder whose index names no pipeline class
    transformer_classes: tuple[str, ...]
    #: ModelFolder -> ModelSpec, or "module:function" imported on first use
    describe: Callable[[ModelFolder], ModelSpec] | str
    #: its folders are diffusers pipelines (their classes are checked against
    #: diffusers'); False for a family with a pipeline class of its own
    diffusers: bool = True


def load_object(path: str) -> Any:
    """``"module:attribute"`` -> the attribute (the module imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["Family", "ModelFolder", "load_object"]
