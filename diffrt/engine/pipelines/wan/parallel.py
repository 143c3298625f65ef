"""Wan's video tokens split over the sequence group (Ulysses, ring, both).

diffusers' ``WanTransformer3DModel.forward`` runs as it is; hooks on its
modules cut it where a token's work is its own:

- the rotary table (``rope``'s output, one row per video token): this
  rank's rows;
- the first block's input (the patch embedding's tokens): this rank's slice;
- each block's self-attention (``attn1``): queries, keys and values of this
  rank's tokens, rotated by its rows of the table, attended over the whole
  clip through the split's joint attention (``text_len`` 0: Wan's text
  enters by cross-attention, not beside the video tokens);
- the cross-attention (``attn2``), the norms, the feed-forward, the output
  norm: per token, run on this rank's slice as they are;
- ``proj_out``'s output: gathered, so the model un-patchifies the whole clip
  on every rank (``SequenceSplit.end``; the call layer's own end then has
  nothing left to gather).

Tokens are frame-major (``latents.py``): a rank's slice is a run of whole
frames or part of one, which the rotary rows follow. A call whose tokens do
not divide by the group runs whole on every rank (``SequenceSplit.begin``).
Wan 2.2's two experts each get the hooks. Wan 2.2 TI2V-5B's per-token
timestep (``expand_timesteps``) is not run by this family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from diffrt.engine.parallel.sequence import SequenceSplit

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanAttention


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary (``WanAttnProcessor``'s ``apply_rotary_emb``):
    (B, S, H, D) by (1, S, 1, D) tables, interleaved pairs."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class SequenceParallelWanAttnProcessor:
    """``WanAttnProcessor`` for the blocks' self-attention over a split clip
    (see the module): the projections, q/k norms and rotary as diffusers
    computes them, the attention over the group."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split = split

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the sequence-parallel Wan processor runs self-attention only")
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        out = self.split.attention(query.transpose(1, 2), key.transpose(1, 2),
                                   value.transpose(1, 2), 0).transpose(1, 2)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def shard_model(model: WanTransformer3DModel, split: SequenceSplit) -> None:
    """One expert's hooks (see the module), installed once."""

    def shard_rotary(_module: nn.Module, _args: Any, out: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return split.shard(out[0], 1), split.shard(out[1], 1)

    def shard_tokens(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (split.shard(args[0], 1), *args[1:])

    def gather_tokens(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return split.end(out, 1)

    model.rope.register_forward_hook(shard_rotary)
    model.blocks[0].register_forward_pre_hook(shard_tokens)
    model.proj_out.register_forward_hook(gather_tokens)
    for block in model.blocks:
        block.attn1.set_processor(SequenceParallelWanAttnProcessor(split))


def shard_experts(experts: list[WanTransformer3DModel], split: SequenceSplit) -> None:
    """Every expert's hooks (Wan 2.2: ``transformer`` and ``transformer_2``)."""
    for model in experts:
        shard_model(model, split)


__all__ = ["SequenceParallelWanAttnProcessor", "shard_experts", "shard_model"]
