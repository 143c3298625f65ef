"""Components shipped as one GGUF file (llama.cpp's format: Q8_0, Q4_K, ...).

A component folder that holds a ``*.gguf`` file beside its ``config.json``
(e.g. a FLUX.1 transformer converted by city96's tools, dropped into a
diffusers folder in place of its safetensors) is loaded by diffusers'
``from_single_file`` with ``GGUFQuantizationConfig``: the weights stay in
their GGUF blocks in memory and each layer dequantises them to the compute
dtype per call (on every device; no kernel of diffrt's own). The folder's
``config.json`` says what model they are; the file's tensor names may be
the original checkpoint's or diffusers' own (diffusers converts the first).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from diffusers import ModelMixin

GGUF_MISSING = "GGUF weights need the gguf package: pip install 'diffrt[quant]'"


def gguf_path(sub: str) -> str | None:
    """The component folder's GGUF file (None: it has none)."""
    try:
        files = sorted(f for f in os.listdir(sub) if f.endswith(".gguf"))
    except OSError:
        return None
    return os.path.join(sub, files[0]) if files else None


def gguf_available() -> bool:
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def file_types(path: str) -> str:
    """The quantisation types the file's tensors use, most bytes first
    ("Q8_0, F32")."""
    from gguf import GGUFReader

    held: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        held[tensor.tensor_type.name] = held.get(tensor.tensor_type.name, 0) + int(
            tensor.n_bytes)
    return ", ".join(sorted(held, key=lambda k: -held[k]))


def tensor_bytes(path: str, value_bytes: int) -> int:
    """What the file's tensors take in memory once loaded: quantised ones as
    stored, float ones at the compute dtype's size."""
    from gguf import GGUFReader

    total = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type.name in ("F32", "F16", "BF16"):
            total += int(tensor.n_elements) * value_bytes
        else:
            total += int(tensor.n_bytes)
    return total


def load_gguf(cls: type[ModelMixin], sub: str, dtype: torch.dtype) -> ModelMixin:
    """``cls`` (a diffusers model class) from the folder's GGUF file, its
    config from the folder, offline."""
    from diffusers import GGUFQuantizationConfig

    path = gguf_path(sub)
    assert path is not None
    return cls.from_single_file(path, config=sub, local_files_only=True, torch_dtype=dtype,
                                quantization_config=GGUFQuantizationConfig(compute_dtype=dtype))


def write_gguf(model: torch.nn.Module, path: str, kind: str = "Q8_0") -> None:
    """Write ``model``'s state dict as a GGUF file under its diffusers names
    with gguf's own writer: 2-D weights whose rows divide into the type's
    blocks quantised to ``kind`` (a ``GGMLQuantizationType`` name), the rest
    float32. What the tests and ``bench_memory`` load; real conversions come
    from llama.cpp's and city96's tools."""
    import gguf

    quant = gguf.GGMLQuantizationType[kind]
    block, _ = gguf.GGML_QUANT_SIZES[quant]
    writer = gguf.GGUFWriter(path, arch="diffrt")
    for name, tensor in model.state_dict().items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[1] % block == 0 and name.endswith(".weight"):
            data = gguf.quants.quantize(values, quant)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quant)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_folder(source: str, target: str, kind: str = "Q8_0") -> str:
    """A copy of the diffusers folder ``source`` at ``target`` whose
    transformer's weights are one GGUF file of ``kind`` (written by
    ``write_gguf`` from the folder's own)."""
    import shutil

    import diffusers

    from diffrt.engine.models.folder_check import read_json_object

    shutil.copytree(source, target)
    sub = os.path.join(target, "transformer")
    _library, class_name = read_json_object(os.path.join(source, "model_index.json"))[
        "transformer"]
    model = getattr(diffusers, class_name).from_pretrained(os.path.join(source, "transformer"))
    for file in os.listdir(sub):
        if file.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            os.remove(os.path.join(sub, file))
    write_gguf(model, os.path.join(sub, f"transformer-{kind}.gguf"), kind)
    return target


__all__ = ["GGUF_MISSING", "file_types", "gguf_available", "gguf_folder", "gguf_path",
           "load_gguf", "tensor_bytes", "write_gguf"]
