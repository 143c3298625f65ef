"""Flux's transformer call cut at its blocks (``engine.cache.forward``).

The operations of diffusers' ``FluxTransformer2DModel.forward`` in its
order — embeddings, the double-stream then the single-stream blocks, the
output norm and projection — over diffusers' own modules, so running every
block over every row gives diffusers' bits. The rotary table is the model's
own (one for all rows) in a uniform call, or one per row with the padding
mask in a mixed-size call (``mixed.py``'s processor is then installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffrt.engine.cache.forward import TransformerBlocks

if TYPE_CHECKING:
    from diffusers import FluxTransformer2DModel


class FluxBlocks(TransformerBlocks):
    """See the module; ``rotary`` (cos, sin) is (tokens, dim) shared, or
    (rows, tokens, dim) per row with ``attention_mask`` (rows, keys)."""

    def __init__(self, model: FluxTransformer2DModel, *, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor,
                 timestep: torch.Tensor, guidance: torch.Tensor | None,
                 rotary: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None):
        self.model = model
        self.hidden = model.x_embedder(hidden_states)
        timestep = timestep.to(self.hidden.dtype) * 1000
        if guidance is None:
            self.temb = model.time_text_embed(timestep, pooled_projections)
        else:
            self.temb = model.time_text_embed(timestep, guidance.to(self.hidden.dtype) * 1000,
                                              pooled_projections)
        self.encoder = model.context_embedder(encoder_hidden_states)
        self.blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        self.count = len(self.blocks)
        per_row = rotary[0].dim() == 3  # a table per row
        self.row_inputs = {"temb": self.temb, **self.attention_inputs(attention_mask)}
        self.shared_inputs = {}
        if per_row:
            self.row_inputs["image_rotary_emb"] = rotary
        else:
            self.shared_inputs["image_rotary_emb"] = rotary
        if attention_mask is None:
            self.shared_inputs["joint_attention_kwargs"] = None
