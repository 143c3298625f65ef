"""Uneven splits: a length shared out over a group, and its parts gathered back."""

from __future__ import annotations

import torch
import torch.distributed as dist


def shares(length: int, parts: int) -> list[int]:
    """``length`` items split in ``parts`` as ``torch.tensor_split`` does (the
    first parts one longer when it does not divide; some may be empty)."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def share(length: int, group: dist.ProcessGroup | None) -> slice:
    """This rank's part of ``length`` items split over ``group`` (``shares``)."""
    sizes = shares(length, dist.get_world_size(group))
    rank = dist.get_rank(group)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def gather_uneven(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                  lengths: list[int]) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; rank i's
    part is ``lengths[i]`` long there (known to every rank, so nothing but
    the data is exchanged). Parts are padded to the longest for the gather
    (collectives take equal shapes) and cut back."""
    pad = list(x.shape)
    pad[dim] = max(lengths) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths, strict=True)], dim=dim)


__all__ = ["gather_uneven", "share", "shares"]
