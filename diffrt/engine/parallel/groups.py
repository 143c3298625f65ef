"""The ranks of an engine laid out over its parallel dimensions.

``world = cfg × ring × ulysses``; a rank's coordinates are
``rank = (c * ring + r) * ulysses + u``, Ulysses innermost so the ranks of
one all-to-all are neighbours (the same machine, the fastest links), the
CFG pair outermost (one all_gather per step: the least traffic).

```
cfg 2 × ulysses 2 (4 ranks):         cfg 2 × ring 2 × ulysses 2 (8 ranks):
  rank 0: cond,   image half 0         ranks 0-3: cond;  4-7: uncond
  rank 1: cond,   image half 1         within each four, image quarter = r*2 + u,
  rank 2: uncond, image half 0         Ulysses between (u=0, u=1), the ring
  rank 3: uncond, image half 1         between (r=0, r=1)
```

One process group per dimension and per fixed value of the others, built
by every rank in the same order (``torch.distributed.new_group`` is a
collective). A dimension of size 1 has no group (None): nothing to exchange.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from diffrt.engine.parallel.attention import (
    JointAttention,
    joint_ring_attention,
    joint_ulysses_attention,
    local_attention,
)
from diffrt.engine.parallel.degrees import ParallelDegrees


@dataclass
class ParallelGroups:
    """This rank's process groups, one per parallel dimension (None where the
    dimension has one rank), and all ranks together (the VAE decode's group)."""

    degrees: ParallelDegrees
    cfg: dist.ProcessGroup | None = None
    ulysses: dist.ProcessGroup | None = None
    ring: dist.ProcessGroup | None = None
    #: ranks sharing the image tokens (ring × Ulysses): shard and gather
    sequence: dist.ProcessGroup | None = None
    all_ranks: dist.ProcessGroup | None = None

    def sequence_attention(self) -> JointAttention:
        """Joint attention (text first, then this rank's image tokens) over the
        sequence group: Ulysses, ring, or Ulysses inside the ring (USP)."""
        attend: JointAttention = local_attention
        if self.ring is not None:
            attend = functools.partial(joint_ring_attention, group=self.ring)
        if self.ulysses is not None:
            attend = functools.partial(joint_ulysses_attention, group=self.ulysses, inner=attend)
        return attend


def build_groups(degrees: ParallelDegrees) -> ParallelGroups:
    """Create the process groups of ``degrees`` in the initialised default
    group (whose size must equal ``degrees.world_size``)."""
    world = dist.get_world_size()
    if world != degrees.world_size:
        raise RuntimeError(f"the parallel degrees {degrees} need {degrees.world_size} ranks, "
                           f"the process group has {world}")
    c0, r0, u0 = degrees.coords(dist.get_rank())
    groups = ParallelGroups(degrees=degrees, all_ranks=dist.group.WORLD)
    cs, rs, us = range(degrees.cfg), range(degrees.ring), range(degrees.ulysses)

    def build(dimension: str, members: Iterable[tuple[object, list[int]]]) -> None:
        """One new_group per value of the other coordinates; keep ours."""
        for key, ranks in members:
            group = dist.new_group(sorted(ranks))
            if key == mine[dimension]:
                setattr(groups, dimension, group)

    mine = {"cfg": (r0, u0), "ring": (c0, u0), "ulysses": (c0, r0), "sequence": c0}
    if degrees.cfg > 1:
        build("cfg", (((r, u), [degrees.rank_of(c, r, u) for c in cs])
                      for r, u in itertools.product(rs, us)))
    if degrees.ring > 1:
        build("ring", (((c, u), [degrees.rank_of(c, r, u) for r in rs])
                       for c, u in itertools.product(cs, us)))
    if degrees.ulysses > 1:
        build("ulysses", (((c, r), [degrees.rank_of(c, r, u) for u in us])
                          for c, r in itertools.product(cs, rs)))
    if degrees.ring > 1 and degrees.ulysses > 1:  # else the one that splits is the same group
        build("sequence", ((c, [degrees.rank_of(c, r, u) for r in rs for u in us]) for c in cs))
    else:
        groups.sequence = groups.ring if degrees.ring > 1 else groups.ulysses
    return groups


__all__ = ["ParallelGroups", "build_groups"]
