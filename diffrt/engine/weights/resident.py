"""The bytes a module's weights hold, counted from their storages.

A parameter's ``numel() * element_size()`` says what it would take as a
plain tensor; a quantised weight is a tensor subclass (torchao's) whose
real data are inner tensors (int8 values, scales, zero points), and
layerwise casting keeps parameters in float8 between calls. Counting the
storages they sit in — each once, however many tensors view it — is what
the memory holds, so a fake quantise-then-dequantise (float weights with an
int8 copy beside them) shows at its real size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def _leaves(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data (itself when plain)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield tensor
        return
    names, _ = flatten(tensor)
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from _leaves(inner)


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storages holding ``tensor``'s data (a subclass's inner tensors)."""
    return sum(leaf.untyped_storage().nbytes() for leaf in _leaves(tensor))


def resident_bytes(module: torch.nn.Module,
                   skip: Iterable[torch.nn.Module] = ()) -> dict[str, int]:
    """Device type ("cpu", "cuda", ...) -> bytes of the storages that
    ``module``'s parameters and buffers hold there, each storage once
    (those of the submodules in ``skip`` left out)."""
    skipped = {id(t) for sub in skip for t in (*sub.parameters(), *sub.buffers())}
    seen: set[tuple[str, int]] = set()
    held: dict[str, int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in skipped:
            continue
        for leaf in _leaves(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor):
            if leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            key = (leaf.device.type, storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            held[leaf.device.type] = held.get(leaf.device.type, 0) + storage.nbytes()
    return held


__all__ = ["resident_bytes", "storage_bytes"]
