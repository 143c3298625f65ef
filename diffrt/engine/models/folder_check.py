"""Checks a diffusers model folder before anything loads it.

Loading a broken folder deep inside diffusers or safetensors ends in a
traceback that rarely names the file at fault. These checks run in the engine
process when the model is resolved (before any worker starts) and say, in one
line, which file is wrong and how: missing, not JSON, not a JSON object, a
weights file shorter than its own header says, a model component without
weights, a pipeline or component class that diffusers / transformers do not
have, and weights that do not match their component's config.json (another
layer count, head count or channel count: diffusers would initialise the
missing weights at random, or fail copying out of a meta tensor).

The last check builds each model component from its config.json on the meta
device (no memory, milliseconds) and compares its tensors' names and shapes
with the safetensors headers; it needs diffusers and transformers imported,
so it is skipped for the folders diffrt writes or ships itself (built from
those very configs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers import ModelMixin
    from transformers import PreTrainedModel


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the problem."""


#: a JSON object as a model folder's files hold it (config.json, model_index.json:
#: values of any JSON type), and the configs the tiny folders are written from
JsonObject = dict[str, Any]
#: tensor name -> shape
Shapes = dict[str, tuple[int, ...]]


def read_json_object(path: str) -> JsonObject:
    """The JSON object in ``path``, or ModelLoadError naming the file."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, found a {type(value).__name__}")
    return value


def check_safetensors(path: str) -> None:
    """A safetensors file must hold its whole header and every tensor it lists."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: truncated ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", head)
            if 8 + header_len > size:
                raise ModelLoadError(
                    f"{path}: truncated ({size} bytes; its header alone needs {8 + header_len})")
            header = json.loads(f.read(header_len))
    except ModelLoadError:
        raise
    except (ValueError, UnicodeDecodeError):
        raise ModelLoadError(f"{path}: not a safetensors file (unreadable header)") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: not a safetensors file (unreadable header)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ModelLoadError(f"{path}: not a safetensors file (bad entry {name!r})") from None
    if 8 + header_len + end > size:
        raise ModelLoadError(f"{path}: truncated ({size} bytes; its tensors need "
                             f"{8 + header_len + end})")


#: files that hold a component's weights (one file, shards with an index, pickles)
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json",
                   ".pt", ".pth", ".ckpt", ".gguf")
#: libraries whose component classes are checked by name
_LIBRARIES = ("diffusers", "transformers")


def check_model_folder(folder: str, *, diffusers_pipeline: bool = True) -> JsonObject:
    """Check ``folder``'s model_index.json and every component it lists (the
    folder exists, its JSON files parse, its safetensors files are whole, a
    model component has weights, and, for folders diffrt did not write, the
    classes exist and the weights match the configs). ``diffusers_pipeline``
    False: the folder's pipeline class is a plugin family's own, not a
    diffusers class. Returns the index."""
    index_path = os.path.join(folder, "model_index.json")
    index = read_json_object(index_path)
    models: list[tuple[str, str, str, str]] = []  # (name, subfolder, library, class)
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        if entry[0] is None:  # an optional component the folder leaves out
            continue
        sub = os.path.join(folder, name)
        if not os.path.isdir(sub):
            raise ModelLoadError(f"{sub}: missing (model_index.json lists component {name!r})")
        files = sorted(os.listdir(sub))
        for file in files:
            path = os.path.join(sub, file)
            if file.endswith(".json"):
                read_json_object(path)
            elif file.endswith(".safetensors"):
                check_safetensors(path)
        if "config.json" in files and not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
            raise ModelLoadError(f"{sub}: component {name!r} has a config.json but no weights "
                                 "(no *.safetensors, *.bin or *.gguf file)")
        if entry[0] in _LIBRARIES:
            models.append((name, sub, entry[0], entry[1]))
    if not _written_by_diffrt(folder):  # the cheap checks passed: now the classes
        with _quiet_libraries():
            if diffusers_pipeline and "_class_name" in index:  # else: the transformer's family
                _check_class(index_path, "_class_name", "diffusers", index.get("_class_name"),
                             pipeline=True)
            for name, sub, library, class_name in models:
                cls = _check_class(index_path, name, library, class_name)
                if cls is not None and os.path.isfile(os.path.join(sub, "config.json")):
                    check_weights_match(sub, name, library, cls)
    return index


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """diffusers' and transformers' import-time and construction warnings off:
    the check's answer is one line or nothing."""
    loggers = [logging.getLogger(name) for name in _LIBRARIES]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def _written_by_diffrt(folder: str) -> bool:
    """A shipped model folder (inside the package) or an embedded one (in the
    diffrt cache): diffrt built their weights from their configs."""
    real = os.path.realpath(folder)
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    roots = (os.path.join(package, "models"), os.path.join(cache_dir(), "models"))
    return any(os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root)
               for root in roots)


def cache_dir() -> str:
    """``$DIFFRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/diffrt``, else ``~/.cache/diffrt``
    (here, not in ``embedded``, which imports this module)."""
    explicit = os.environ.get("DIFFRT_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffrt")


def _check_class(index_path: str, name: str, library: str, class_name: object, *,
                 pipeline: bool = False) -> type | None:
    """The class ``library.class_name`` names, or ModelLoadError naming it
    (None when the library is not installed: the loader says so)."""
    what = "pipeline _class_name" if pipeline else f"component {name!r} class"
    if not isinstance(class_name, str) or not class_name:
        raise ModelLoadError(f"{index_path}: {what} must be a class name, got {class_name!r}")
    try:
        module = __import__(library)
    except ImportError:
        return None
    if pipeline:  # named by the library (its lazy index): its module is not imported
        if class_name.endswith("Pipeline") and class_name in dir(module):
            return None
        cls = None
    else:
        cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ModelLoadError(f"{index_path}: {what} {class_name!r} is not a {library} "
                             f"{'pipeline' if pipeline else 'class'}")
    return cls


def check_weights_match(sub: str, name: str, library: str, cls: type) -> None:
    """ModelLoadError naming ``name`` and the first mismatch when the weights in
    ``sub`` are not those of the model its config.json builds: a repeated
    block counted differently, or a tensor of another shape. Nothing is said
    of what cannot be told apart from a checkpoint's renamed keys."""
    weights = weight_shapes(sub)
    if not weights:  # pickled weights only: not read here
        return
    try:
        built = _meta_shapes(sub, library, cls)
    except Exception:  # a config this class cannot build: the loader says why
        return
    problem = _layer_count_mismatch(weights, built) or _shape_mismatch(weights, built)
    if problem:
        raise ModelLoadError(f"{sub}: the weights of component {name!r} do not match its "
                             f"config.json: {problem}")


def weight_shapes(sub: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of the component's safetensors files
    (the default load's: no fp16/bf16 variants)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(os.listdir(sub)):
        if not file.endswith(".safetensors") or _VARIANT.search(file):
            continue
        with open(os.path.join(sub, file), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(entry["shape"])
    return shapes


def model_shapes(sub: str) -> dict[str, tuple[int, ...]]:
    """``weight_shapes``, or where the weights are pickled (a pre-quantised
    torchao save) the shapes of the model its config.json builds, unquantised
    (empty when no class builds it)."""
    shapes = weight_shapes(sub)
    if shapes:
        return shapes
    try:
        with open(os.path.join(sub, "config.json")) as f:
            config = json.load(f)
        for library, name in (("diffusers", config.get("_class_name")),
                              ("transformers", (config.get("architectures") or [None])[0])):
            cls = getattr(__import__(library), name, None) if isinstance(name, str) else None
            if isinstance(cls, type):
                return _meta_shapes(sub, library, cls)
    except Exception:  # a folder the loader will judge
        return {}
    return {}


def _meta_shapes(sub: str, library: str,
                 cls: type[ModelMixin] | type[PreTrainedModel]) -> Shapes:
    """Tensor name -> shape of the model ``cls`` builds from ``sub``'s
    config.json, on the meta device."""
    import torch

    with torch.device("meta"):
        if library == "diffusers":
            model = cls.from_config(cls.load_config(sub))
        else:
            model = cls(cls.config_class.from_pretrained(sub))
    return {key: tuple(t.shape) for key, t in model.state_dict().items()}


_VARIANT = re.compile(r"\.(fp16|bf16|fp32|ema|non_ema)[.-]")
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")


def _layer_count_mismatch(weights: Shapes, built: Shapes) -> str | None:
    """"transformer_blocks: 2 in the weights, 3 by config.json" for the first
    repeated block whose count differs."""
    def counts(keys: Iterable[str]) -> dict[str, int]:
        found: dict[str, set[int]] = {}
        for key in keys:
            match = _BLOCK.match(key)
            if match:
                found.setdefault(match.group(1), set()).add(int(match.group(2)))
        return {prefix: max(ids) + 1 for prefix, ids in found.items()}

    have, want = counts(weights), counts(built)
    for prefix in sorted(set(have) & set(want)):
        if have[prefix] != want[prefix]:
            return f"{prefix}: {have[prefix]} in the weights, {want[prefix]} by config.json"
    return None


def _shape_mismatch(weights: Shapes, built: Shapes) -> str | None:
    differ = sorted(k for k in set(weights) & set(built) if tuple(weights[k]) != built[k])
    if not differ:
        return None
    first = differ[0]
    more = f" (and {len(differ) - 1} more tensors)" if len(differ) > 1 else ""
    return (f"{first} is {list(weights[first])} in the weights, {list(built[first])} by "
            f"config.json{more}")
