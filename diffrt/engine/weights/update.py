"""A weight update in a worker, in two phases (docs/rollouts.md).

``stage`` reads the new tensors (a safetensors file, or a folder of them:
the engine writes a caller's mapping as one file in shared memory) into host
memory beside the live weights, checks each name and shape against the
module, and answers a checksum of what it read. The engine compares every
rank's checksum with the one it computed from the source; only when all
agree does it send ``commit`` (the staged tensors are copied into the
module's parameters, in place) — otherwise ``discard``, and the old weights
stay. The engine sends both between ticks, when no request is running, so
a request never mixes two versions.

A commit may keep a host copy of what it replaced (``PreviousWeights``):
Ray Serve's replicas apply an update one by one, and when one of them fails
the others put their previous weights back (``serve/ray_weights.py``).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

import torch


class WeightUpdateError(ValueError):
    """The source cannot update this model's weights (names, shapes, files)."""


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of ``path``: itself, or a folder's, sorted."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if files:
            return files
        raise WeightUpdateError(f"{path}: no .safetensors file in this folder")
    raise WeightUpdateError(f"{path}: no such file or folder")


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``path``'s safetensors files, by name (a name in two
    files is refused)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(file).items():
            if name in tensors:
                raise WeightUpdateError(f"{file}: {name!r} is in another file of {path} too")
            tensors[name] = tensor
    return tensors


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 over every tensor's name, dtype, shape and bytes, in name
    order: what a rank read, compared between ranks and with the source."""
    crc = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        head = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}"
        crc = zlib.crc32(head.encode(), crc)
        if tensor.numel():
            data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc = zlib.crc32(data.data, crc)
    return f"{crc:08x}"


class StagedUpdate:
    """The tensors of one update, read and checked, waiting for ``commit``."""

    def __init__(self, module: torch.nn.Module, path: str):
        params: dict[str, torch.Tensor] = dict(module.named_parameters())
        params.update(module.named_buffers())
        tensors = read_tensors(path)
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise WeightUpdateError(
                f"{len(unknown)} name(s) the model does not have, e.g. {unknown[0]!r} (names are "
                "the transformer's own, as its state_dict() gives them)")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightUpdateError(f"{name}: shape {list(tensor.shape)}, the model's is "
                                        f"{list(params[name].shape)}")
        self.tensors = tensors
        self.targets = {name: params[name] for name in tensors}
        self.checksum = checksum(tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    @torch.no_grad()
    def commit(self, keep_previous: bool = False) -> PreviousWeights | None:
        """Copy the staged tensors into the live parameters (in place: hooks,
        compiled graphs and LoRA layers keep pointing at them); with
        ``keep_previous``, a host copy of the values they replace first."""
        previous = PreviousWeights(self.targets) if keep_previous else None
        for name, tensor in self.tensors.items():
            self.targets[name].copy_(tensor)
        self.tensors.clear()
        return previous


class PreviousWeights:
    """Host copies of the parameters a commit replaced, to put back
    (``restore``) when the update is rolled back."""

    def __init__(self, targets: Mapping[str, torch.Tensor]):
        self.targets = dict(targets)
        self.tensors = {name: t.detach().to("cpu", copy=True) for name, t in targets.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def restore(self) -> str:
        """Copy the values back; the checksum of what it put back (computed
        only here: a commit that keeps them pays for the copy alone)."""
        for name, tensor in self.tensors.items():
            self.targets[name].copy_(tensor)
        return checksum(self.tensors)


__all__ = ["PreviousWeights", "StagedUpdate", "WeightUpdateError", "checksum", "read_tensors",
           "safetensors_files"]
