"""Components a folder ships already quantised: with torchao, or as GGUF.

diffusers saves a model quantised through its ``TorchAoConfig`` with the
config beside it (``config.json``'s ``quantization_config``: ``quant_method``
"torchao" and the torchao config's ``_type``) and the weights pickled
(torchao's tensor subclasses have no safetensors form); its
``from_pretrained`` loads them back as they were. diffrt loads such a folder
as any other — diffusers does the work — and needs only to know the method,
to count its bytes, refuse converting it again and report it.
"""

from __future__ import annotations

import json
import os

#: torchao config class -> diffrt's name of the same method
TORCHAO_TYPES = {"Int8WeightOnlyConfig": "int8",
                 "Float8DynamicActivationFloat8WeightConfig": "fp8"}


def folder_method(sub: str) -> str | None:
    """The method a component folder's weights were saved in (``int8``,
    ``fp8``, "torchao <config>" for another torchao config, ``gguf`` for a
    GGUF file: ``gguf_file``), None for weights as trained."""
    from diffrt.engine.models.gguf_file import gguf_path

    if gguf_path(sub) is not None:
        return "gguf"
    try:
        with open(os.path.join(sub, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "torchao":
        return None
    kind = quant.get("quant_type")
    if isinstance(kind, dict) and isinstance(kind.get("default"), dict):
        kind = kind["default"].get("_type")
    return TORCHAO_TYPES.get(str(kind), f"torchao {kind}")


def folder_methods(folder: str) -> dict[str, str]:
    """Component -> its pre-quantised method, for those of ``folder`` that are."""
    found = {}
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if os.path.isdir(sub) and (method := folder_method(sub)) is not None:
            found[name] = method
    return found


__all__ = ["TORCHAO_TYPES", "folder_method", "folder_methods"]
