"""Classifier-free guidance across two ranks.

Rank 0 of the group runs the conditional branch, rank 1 the unconditional
one, each a forward of half the batch rows; one ``all_gather`` before the
noise-scheduler step gives both ranks both predictions, and both apply the
same guidance, so they keep identical latents (the next step needs them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: which branch each rank of a CFG group computes
COND_RANK, UNCOND_RANK = 0, 1


def cfg_parallel_combine(pred: torch.Tensor, guidance_scale: float,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)`` from this rank's branch ``pred``
    (conditional on rank 0, unconditional on rank 1 of ``group``)."""
    if dist.get_world_size(group) != 2:
        raise ValueError("CFG parallel runs on a group of exactly two ranks")
    both = [torch.empty_like(pred) for _ in range(2)]
    dist.all_gather(both, pred.contiguous(), group=group)
    cond, uncond = both[COND_RANK], both[UNCOND_RANK]
    return uncond + guidance_scale * (cond - uncond)


__all__ = ["COND_RANK", "UNCOND_RANK", "cfg_parallel_combine"]
