"""Tensors packed into one flat byte buffer, each at the alignment it had.

Both offloads keep a component's (or block's) weights in one page-locked
host buffer and point each parameter into it, or into a device copy. Where a
tensor starts matters for its bits: CPU kernels split their vector loops at
alignment boundaries, so the same weights at another address modulo 64 sum
in another order (tiny-flux's last bits move by about 3e-6 when its weights
are merely cloned). Each tensor therefore starts at an offset with the
address it had modulo ``ALIGN``; buffers from the allocators are
``ALIGN``-aligned, so a tensor packed here computes as it did where it was
loaded.
"""

from __future__ import annotations

import torch

#: the alignment a tensor keeps (every allocator's buffers are aligned to it)
ALIGN = 64


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def start_at(offset: int, tensor: torch.Tensor) -> int:
    """The first offset from ``offset`` at which ``tensor`` keeps its address
    modulo ``ALIGN``."""
    return offset + (tensor.data_ptr() - offset) % ALIGN


def pack_into(buffer: torch.Tensor, start: int, tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` into ``buffer`` (uint8) at ``start``; its view there."""
    n = nbytes(tensor)
    buffer[start:start + n].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    return view_at(buffer, start, tensor.dtype, tensor.shape)


def view_at(buffer: torch.Tensor, start: int, dtype: torch.dtype,
            shape: torch.Size) -> torch.Tensor:
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buffer[start:start + n].view(dtype).view(shape)


def empty_like_aligned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``tensor`` on ``device``, at ``tensor``'s
    address modulo ``ALIGN`` (its storage is at most ``ALIGN`` bytes more)."""
    raw = torch.empty(nbytes(tensor) + ALIGN, dtype=torch.uint8, device=device)
    start = (tensor.data_ptr() - raw.data_ptr()) % ALIGN
    return view_at(raw, start, tensor.dtype, tensor.shape)


__all__ = ["ALIGN", "empty_like_aligned", "nbytes", "pack_into", "start_at", "view_at"]
