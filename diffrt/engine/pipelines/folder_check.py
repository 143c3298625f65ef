"""Checks a diffusers model folder before anything loads it.

Loading a broken folder deep inside diffusers or safetensors ends in a
traceback that rarely names the file at fault. These checks run in the engine
process when the model is resolved (before any worker starts) and say, in one
line, which file is wrong and how: missing, not JSON, not a JSON object, a
weights file shorter than its own header says.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the problem."""


def read_json_object(path: str) -> dict[str, Any]:
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


def check_model_folder(folder: str) -> dict[str, Any]:
    """Check ``folder``'s model_index.json and every component it lists (the
    folder exists, its JSON files parse, its safetensors files are whole).
    Returns the index."""
    index = read_json_object(os.path.join(folder, "model_index.json"))
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        if entry[0] is None:  # an optional component the folder leaves out
            continue
        sub = os.path.join(folder, name)
        if not os.path.isdir(sub):
            raise ModelLoadError(f"{sub}: missing (model_index.json lists component {name!r})")
        for file in sorted(os.listdir(sub)):
            path = os.path.join(sub, file)
            if file.endswith(".json"):
                read_json_object(path)
            elif file.endswith(".safetensors"):
                check_safetensors(path)
    return index
