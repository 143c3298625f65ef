"""Uneven splits: a length shared out over a group, and its parts gathered back."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def share(length: int, group: Any) -> slice:
    """This rank's part of ``length`` items split over ``group`` as
    ``torch.tensor_split`` does (the first parts one longer when it does not
    divide; a part may be empty when ``length`` < the group's size)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def gather_uneven(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order. The parts
    may differ in length there (even be empty): they are padded to the
    longest for the gather (collectives take equal shapes) and cut back."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[dim]], device=x.device), group=group)
    lengths = [int(s.item()) for s in sizes]
    pad = list(x.shape)
    pad[dim] = max(lengths) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths, strict=True)], dim=dim)


__all__ = ["gather_uneven", "share"]
