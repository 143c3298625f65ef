"""One transformer call's image tokens shared out over the sequence group.

``SequenceSplit`` is the state a family's transformer hooks share: the
group, the joint attention over it (Ulysses, ring, or both), and whether
the current call is split at all. A call whose image tokens do not divide
by the group's size runs whole on every rank (the same numbers, no saving):
splitting it would need padded tokens masked out of every attention.

The call layer ``pipelines.transformer_call.SequenceShard`` owns the split:
it installs the family's hooks once (attention processors, and where a
model cuts its tokens inside its forward, ``ShardTokens`` / ``GatherTokens``)
and begins and ends it around each call. ``ShardTokens`` begins it too, so
a call cut at its blocks for a step cache, which does not pass that layer,
still splits where the model shards.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from diffrt.engine.parallel.attention import JointAttention, local_attention

logger = logging.getLogger(__name__)


class SequenceSplit:
    def __init__(self, group: dist.ProcessGroup | None, attend: JointAttention) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.attend = attend
        #: True while a transformer call runs on this rank's slice of the tokens
        self.active = False
        #: leading text tokens of the joint sequence (set per call where the
        #: attention cannot tell them from image tokens: Flux's single blocks)
        self.text_len = 0
        #: (B, text_len), True for real text tokens; None: no padding (set per
        #: call by a family that batches prompts of different lengths)
        self.text_mask: torch.Tensor | None = None
        self._whole_logged: set[int] = set()

    # The exchanges run eagerly under torch.compile (a graph break each): a
    # compiled transformer keeps its kernels, the collectives stay as written.
    @torch.compiler.disable
    def begin(self, image_tokens: int) -> bool:
        """Start a transformer call over ``image_tokens``; True when it splits."""
        self.active = image_tokens % self.size == 0
        if not self.active and image_tokens not in self._whole_logged:
            self._whole_logged.add(image_tokens)
            logger.info("%d image tokens do not split over %d ranks: such calls run whole "
                        "on every rank", image_tokens, self.size)
        return self.active

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``x`` along ``dim`` (when the call splits)."""
        return x.chunk(self.size, dim=dim)[self.rank] if self.active else x

    @torch.compiler.disable
    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's slice of ``x`` concatenated along ``dim``, in rank order."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def end(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """End the call: its output gathered (see ``gather``)."""
        out = self.gather(x, dim)
        self.active = False
        return out

    @torch.compiler.disable
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  text_len: int) -> torch.Tensor:
        """Joint attention, (B, H, tokens, D), text first: over the group when split."""
        if self.active:
            return self.attend(q, k, v, text_len, text_mask=self.text_mask)
        return local_attention(q, k, v, text_len, text_mask=self.text_mask)


class ShardTokens(nn.Module):
    """Wraps the layer that turns latents into tokens (SD3's patch embedding,
    which also adds the positional embedding): its output, this rank's slice."""

    def __init__(self, inner: nn.Module, split: SequenceSplit) -> None:
        super().__init__()
        self.inner, self.sequence = inner, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.sequence.begin(out.shape[1])
        return self.sequence.shard(out, 1)


class GatherTokens(nn.Module):
    """Wraps the transformer's last per-token layer: its output gathered, so
    the model un-patchifies the whole image on every rank."""

    def __init__(self, inner: nn.Module, split: SequenceSplit) -> None:
        super().__init__()
        self.inner, self.sequence = inner, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequence.end(self.inner(x), 1)


__all__ = ["GatherTokens", "SequenceSplit", "ShardTokens"]
