"""A worker's weights while the engine sleeps (docs/rollouts.md).

Level 1 moves every component's parameters and buffers into page-locked
host memory (``Platform.empty_pinned``) and gives the device's cache back:
the device keeps nothing of the model. Level 2 also drops the transformer's
weights (the largest part, and what a trainer replaces): waking reads them
again from the model's folder. Waking copies everything back to the device,
bit for bit. Where the platform has no page-locked memory (the CPU, whose
"device" is the host) there is nothing to free: sleep is accepted and
changes nothing in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from diffrt.engine.weights.update import read_tensors
from diffrt.platforms.interface import Platform

#: the component level 2 drops (read again from its folder at wake)
DROPPED = "transformer"
#: the alignment whose offset a woken tensor keeps
ALIGN = 64


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Its parameters and buffers, each storage once (tied weights share one)."""
    seen: set[int] = set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _aligned(shape: torch.Size, dtype: torch.dtype, device: torch.device,
             offset: int) -> torch.Tensor:
    """An empty tensor whose address is ``offset`` past a multiple of
    ``ALIGN``, as the one it replaces was (weights loaded from a safetensors
    file sit at the file's offsets)."""
    size = torch.empty(0, dtype=dtype).element_size()
    numel = int(torch.Size(shape).numel())
    if offset % size:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = torch.empty(numel + ALIGN // size, dtype=dtype, device=device)
    shift = (offset - buffer.data_ptr() % ALIGN) % ALIGN // size
    return buffer[shift:shift + numel].view(shape)


class SleepingWeights:
    """What one worker put away for a sleep, until ``wake``."""

    def __init__(self, modules: dict[str, torch.nn.Module], platform: Platform,
                 device: torch.device, level: int, folder: str | None):
        self.level = level
        self.device = device
        self.platform = platform
        self.folder = folder
        #: (name, tensor, its host copy: None when dropped, its address mod
        #: ALIGN: kernels' results may depend on it, MKL's on the CPU)
        self.saved: list[tuple[str, torch.Tensor, torch.Tensor | None, int]] = []
        #: bytes the device no longer holds, and bytes kept in page-locked memory
        self.freed_bytes = 0
        self.pinned_bytes = 0
        if not platform.pinned_memory_available():
            return  # the host is the device: nothing to free
        with torch.no_grad():
            for component, module in modules.items():
                drop = level == 2 and component == DROPPED and folder is not None
                for name, tensor in _tensors(module):
                    nbytes = tensor.numel() * tensor.element_size()
                    host = None
                    if not drop:
                        host = platform.empty_pinned(tuple(tensor.shape), tensor.dtype)
                        host.copy_(tensor.data)
                        self.pinned_bytes += nbytes
                    self.saved.append((name, tensor, host, tensor.data_ptr() % ALIGN))
                    tensor.data = host if host is not None else torch.empty(
                        0, dtype=tensor.dtype, device=device)
                    self.freed_bytes += nbytes
        platform.synchronize()
        platform.empty_cache()

    @property
    def reloads(self) -> bool:
        """Waking reads the transformer from its folder (its updates are gone)."""
        return any(host is None for _, _, host, _ in self.saved)

    @torch.no_grad()
    def wake(self) -> int:
        """Everything back on the device; the bytes restored."""
        files = (read_tensors(os.path.join(self.folder, DROPPED))
                 if self.reloads and self.folder is not None else {})
        restored = 0
        for name, tensor, host, offset in self.saved:
            source = host if host is not None else files[name]
            data = _aligned(source.shape, tensor.dtype, self.device, offset)
            data.copy_(source)
            tensor.data = data
            restored += data.numel() * data.element_size()
        self.saved.clear()
        self.platform.synchronize()
        return restored


__all__ = ["SleepingWeights"]
