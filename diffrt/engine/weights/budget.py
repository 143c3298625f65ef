"""Whether a model's weights fit ``device_memory_budget``, and what would.

Before anything loads, each component's weight bytes are estimated from its
safetensors headers (names, shapes) under the configured methods; after the
workers load, the bytes their storages hold (``resident``) are checked
again. A configuration over the budget is refused naming the settings
(``VARIED``: the methods, ``offload``, ``offload_text_encoders``) whose
estimate fits, fewest changes first.

The estimate per tensor: as loaded, its elements at the compute dtype's
size. A linear layer (a 2-D ``<name>.weight`` other than a text encoder's token or position
table, ``TOKEN_EMBEDDING``) under ``int8`` takes one byte
an element plus a float32 scale and an int8 zero point per output channel; under ``fp8``
one byte plus a float32 scale per row; under ``fp8-storage`` one byte an
element for it and its bias — except the layers diffusers' layerwise
casting skips (norms, embeddings, the patch projections), while the token
tables are cast too.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

#: diffusers' ``DEFAULT_SKIP_MODULES_PATTERN`` (hooks/layerwise_casting.py),
#: the layers ``fp8-storage`` leaves as loaded
FP8_STORAGE_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
#: the text encoders' ``nn.Embedding`` tables (CLIP, T5, Qwen2.5-VL names):
#: 2-D like a linear's weight, but neither torchao method quantises them
TOKEN_EMBEDDING = re.compile(r"(token_embedding|position_embedding|embed_tokens|^shared)$")


def kept_patterns(folder: str) -> tuple[str, ...]:
    """A component's own layers that ``fp8-storage`` leaves as loaded: its
    class's ``_keep_in_fp32_modules`` (T5's ``wo``) and diffusers'
    ``_skip_layerwise_casting_patterns``, from its config's class name."""
    import json

    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ()
    names = [config.get("_class_name"), *(config.get("architectures") or [])]
    for library in ("diffusers", "transformers"):
        module = __import__(library)
        for name in names:
            cls = getattr(module, name, None) if isinstance(name, str) else None
            if cls is not None:
                return (*(getattr(cls, "_keep_in_fp32_modules", None) or ()),
                        *(getattr(cls, "_skip_layerwise_casting_patterns", None) or ()))
    return ()


def _stored_in_fp8(layer: str, kept: tuple[str, ...]) -> bool:
    """diffusers matches its patterns against each module's full name."""
    return not any(re.search(pattern, layer) for pattern in (*FP8_STORAGE_SKIP, *kept))


def tensor_bytes(shapes: dict[str, tuple[int, ...]], method: str, value_bytes: int,
                 kept: tuple[str, ...] = ()) -> int:
    """Estimated bytes of one component's tensors (``shapes``: name -> shape)
    under ``method`` at ``value_bytes`` per value (``kept``: its own
    ``kept_patterns``)."""
    linears = {name[:-len(".weight")] for name, shape in shapes.items()
               if name.endswith(".weight") and len(shape) == 2
               and not TOKEN_EMBEDDING.search(name[:-len(".weight")])}
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        layer, _, leaf = name.rpartition(".")
        if method == "fp8-storage":  # every layer but the skipped ones, tables included
            total += numel * (1 if _stored_in_fp8(layer, kept) else value_bytes)
        elif method == "none" or layer not in linears:
            total += numel * value_bytes
        elif leaf != "weight":  # a quantised linear's bias stays as loaded
            total += numel * value_bytes
        elif method == "int8":
            total += numel + shape[0] * 5  # torchao: a float32 scale, an int8 zero point
        else:  # fp8: float8 values, one float32 scale a row
            total += numel + shape[0] * 4
    return total


@dataclass(frozen=True)
class Component:
    """One component's tensors (name -> shape, from its safetensors headers)
    and the layers ``fp8-storage`` keeps (``kept_patterns``)."""

    shapes: dict[str, tuple[int, ...]]
    kept: tuple[str, ...] = ()
    #: the method the folder saved it in (``prequantized``), which the
    #: settings do not change; None: as trained
    saved: str | None = None
    #: its GGUF file (``saved`` "gguf"), whose tensors' sizes are read from it
    gguf: str | None = None

    def bytes(self, method: str, value_bytes: int) -> int:
        if self.gguf is not None:
            from diffrt.engine.models.gguf_file import tensor_bytes as gguf_bytes

            return gguf_bytes(self.gguf, value_bytes)
        chosen = self.saved if self.saved in ("int8", "fp8") else (
            "none" if self.saved else method)
        return tensor_bytes(self.shapes, chosen, value_bytes, self.kept)


def components(folder: str) -> dict[str, Component]:
    """The transformers (Wan 2.2's two experts: ``transformer`` and
    ``transformer_2``), the VAE and the text encoders of a diffusers folder."""
    from diffrt.engine.models.folder_check import model_shapes
    from diffrt.engine.models.gguf_file import gguf_path
    from diffrt.engine.weights.prequantized import folder_method

    return {name: Component(model_shapes(sub), kept_patterns(sub), folder_method(sub),
                            gguf_path(sub))
            for name in sorted(os.listdir(folder))
            if (name in ("transformer", "transformer_2", "vae")
                or name.startswith("text_encoder"))
            and os.path.isdir(sub := os.path.join(folder, name))}


#: the settings ``device_bytes`` reads and ``what_fits`` varies (with
#: ``offload_prefetch``, which it reads only)
VARIED = ("quantization", "text_encoder_quantization", "offload", "offload_text_encoders")

_BLOCK = re.compile(r"^([A-Za-z_]+)\.(\d+)\.")


def _block_bytes(part: Component, method: str, value_bytes: int) -> tuple[int, list[int]]:
    """A transformer's bytes outside its repeated blocks, and each block's
    (a block: ``<list>.<i>.`` where ``<list>`` has two or more, as
    ``offload.transformer_blocks`` finds them)."""
    groups: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
    for name, shape in part.shapes.items():
        if match := _BLOCK.match(name):
            groups.setdefault((match[1], match[2]), {})[name] = shape
    lists: dict[str, int] = {}
    for prefix, _ in groups:
        lists[prefix] = lists.get(prefix, 0) + 1
    blocks = {key: shapes for key, shapes in groups.items() if lists[key[0]] >= 2}
    inside = {name for shapes in blocks.values() for name in shapes}
    rest = {name: shape for name, shape in part.shapes.items() if name not in inside}
    return (tensor_bytes(rest, method, value_bytes, part.kept),
            [tensor_bytes(shapes, method, value_bytes, part.kept) for shapes in blocks.values()])


def device_bytes(parts: dict[str, Component], value_bytes: int,
                 settings: dict[str, object]) -> int:
    """Estimated weight bytes on the device at their peak under ``settings``
    (``VARIED`` and ``offload_prefetch``): everything; under
    ``offload="layerwise"`` each transformer's non-block weights and
    ``offload_prefetch + 1`` of the largest block (the slots every streamed
    transformer shares: Wan 2.2's two experts); under ``offload="model"``
    the largest component (one expert at a time); under
    ``offload_text_encoders`` the others and the largest text encoder (one is
    on the device while it encodes). ``quantization`` converts every
    transformer (both experts)."""
    sizes: dict[str, int] = {}
    largest_block = 0
    for name, part in parts.items():
        text = name.startswith("text_encoder")
        transformer = name.startswith("transformer")
        method = str(settings["text_encoder_quantization"] if text else
                     settings["quantization"] if transformer else "none")
        if transformer and settings["offload"] == "layerwise":
            rest, blocks = _block_bytes(part, method, value_bytes)
            sizes[name] = rest
            largest_block = max(largest_block, *blocks, 0)
        else:
            sizes[name] = part.bytes(method, value_bytes)
    if largest_block:
        prefetch = settings.get("offload_prefetch", 1)
        assert isinstance(prefetch, int)  # a declared int setting
        sizes["transformer"] += (prefetch + 1) * largest_block
    if settings["offload"] == "model":
        return max(sizes.values(), default=0)
    texts = [n for name, n in sizes.items() if name.startswith("text_encoder")]
    if settings["offload_text_encoders"] and texts:
        return sum(sizes.values()) - sum(texts) + max(texts)
    return sum(sizes.values())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def what_fits(parts: dict[str, Component], value_bytes: int, budget: int, *,
              current: dict[str, object], methods: Iterable[str], host_is_device: bool) -> str:
    """The settings whose estimate fits ``budget`` (at most three, fewest
    changes from ``current`` first), or the smallest estimate when none does."""
    text_methods = ("none", "fp8-storage", "int8")
    offloads = [("none", False)] if host_is_device else [
        ("none", False), ("none", True), ("layerwise", False), ("layerwise", True),
        ("model", False)]
    saved = {name for name, part in parts.items() if part.saved}
    transformer_saved = "transformer" in saved
    text_saved = any(name.startswith("text_encoder") for name in saved)
    options = []
    for quant, text, (offload, texts) in itertools.product(["none", *methods], text_methods,
                                                           offloads):
        # what the configuration refuses: layer-wise offload of quantised
        # weights, converting what the folder saved quantised
        if offload == "layerwise" and (quant != "none" or transformer_saved):
            continue
        if (quant != "none" and transformer_saved) or (text != "none" and text_saved):
            continue
        if offload != "none" and quant == "fp8":
            continue
        choice = {"quantization": quant, "text_encoder_quantization": text,
                  "offload": offload, "offload_text_encoders": texts}
        need = device_bytes(parts, value_bytes, {**current, **choice})
        changes = {k: v for k, v in choice.items() if current.get(k) != v}
        options.append((len(changes), need, changes))
    fits = sorted((o for o in options if o[1] <= budget and o[0]), key=lambda o: (o[0], o[1]))
    if not fits:
        smallest = min(options, key=lambda o: o[1])
        return (f"no weight setting fits it (the smallest, "
                f"{_settings(smallest[2]) or 'as configured'}, needs about {_gib(smallest[1])})")
    return "it fits with " + " or ".join(
        f"{_settings(changes)} (about {_gib(need)})" for _, need, changes in fits[:3])


def refusal(need: int, budget: int, folder: str | None, value_bytes: int, *,
            current: dict[str, object], methods: Iterable[str], host_is_device: bool,
            measured: bool = False) -> str:
    """The one-line reason a configuration over ``device_memory_budget`` is
    refused: what it needs and, from the folder's estimate, what would fit."""
    what = "the loaded weights hold" if measured else "the weights need about"
    line = (f"{what} {_gib(need)} on the device, over the budget of {_gib(budget)}")
    if folder is None:
        return line
    return line + "; " + what_fits(components(folder), value_bytes, budget,
                                   current=current, methods=methods, host_is_device=host_is_device)


def weight_settings(model: object) -> dict[str, object]:
    """The settings ``what_fits`` varies, as ``model`` (a ModelConfig) has them."""
    return {name: getattr(model, name) for name in (*VARIED, "offload_prefetch")}


def _settings(changes: dict[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in changes.items())


__all__ = ["FP8_STORAGE_SKIP", "TOKEN_EMBEDDING", "VARIED", "Component", "components", "device_bytes",
           "kept_patterns", "refusal", "tensor_bytes", "weight_settings", "what_fits"]
