"""Classifier-free guidance across two ranks.

Rank 0 of the group runs the conditional branch, rank 1 the unconditional
one, each a forward of half the batch rows; one ``all_gather`` before the
noise-scheduler step gives both ranks both predictions, and both apply the
same guidance, so they keep identical latents (the next step needs them).

A batch without CFG has no second branch: its rows are shared out between
the two ranks instead (``rows_here``, ``gather_rows``); a single row is
computed by both (sending it would cost more than the idle rank saves).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diffrt.engine.parallel.collectives import gather_uneven, share, shares

#: which branch each rank of a CFG group computes
COND_RANK, UNCOND_RANK = 0, 1


def gather_branches(pred: torch.Tensor,
                    group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional, unconditional) predictions on both ranks, from this
    rank's branch ``pred`` (conditional on rank 0 of ``group``, unconditional
    on rank 1); the family then combines them (``combine_guidance``)."""
    if dist.get_world_size(group) != 2:
        raise ValueError("CFG parallel runs on a group of exactly two ranks")
    both = [torch.empty_like(pred) for _ in range(2)]
    dist.all_gather(both, pred.contiguous(), group=group)
    return both[COND_RANK], both[UNCOND_RANK]


def cfg_parallel_combine(pred: torch.Tensor, guidance_scale: float | torch.Tensor,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)`` from this rank's branch ``pred``
    (``gather_branches``); a tensor ``guidance_scale`` holds one scale per
    row of ``pred``."""
    cond, uncond = gather_branches(pred, group)
    if isinstance(guidance_scale, torch.Tensor):
        guidance_scale = guidance_scale.view(-1, *([1] * (pred.dim() - 1))).to(pred.dtype)
    return uncond + guidance_scale * (cond - uncond)


def cfg_branch(group: dist.ProcessGroup | None = None) -> bool:
    """True on the rank that computes the conditional branch."""
    return dist.get_rank(group) == COND_RANK


def rows_here(rows: int, group: dist.ProcessGroup | None = None) -> slice:
    """The rows of a CFG-less batch this rank computes (all of a single row)."""
    return share(rows, group) if rows > 1 else slice(0, rows)


def gather_rows(pred: torch.Tensor, rows: int,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Both ranks' ``rows_here`` predictions, in row order, on both ranks."""
    return gather_uneven(pred, 0, group, shares(rows, 2)) if rows > 1 else pred


__all__ = ["COND_RANK", "UNCOND_RANK", "cfg_branch", "cfg_parallel_combine", "gather_branches",
           "gather_rows", "rows_here"]
