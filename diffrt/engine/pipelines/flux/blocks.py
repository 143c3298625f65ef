"""Flux's transformer call cut at its blocks (``engine.cache.forward``).

The operations of diffusers' ``FluxTransformer2DModel.forward`` in its
order — embeddings, the double-stream then the single-stream blocks, the
output norm and projection — over diffusers' own modules, so running every
block over every row gives diffusers' bits. The rotary table is the model's
own (one for all rows) in a uniform call, or one per row with the padding
mask in a mixed-size call (``mixed.py``'s processor is then installed).
"""

from __future__ import annotations

from typing import Any

import torch

from diffrt.engine.cache.forward import TransformerBlocks


class FluxBlocks(TransformerBlocks):
    """See the module; ``rotary`` (cos, sin) is (tokens, dim) shared, or
    (rows, tokens, dim) per row with ``attention_mask`` (rows, keys)."""

    def __init__(self, model: Any, *, hidden_states: torch.Tensor,
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
        self.rotary = rotary
        self.mask = attention_mask

    def run(self, start: int, stop: int, hidden: torch.Tensor, encoder: torch.Tensor | None,
            rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        temb, rotary, mask = self.temb, self.rotary, self.mask
        if rows is not None:
            temb = temb.index_select(0, rows)
            if rotary[0].dim() == 3:  # a table per row
                rotary = (rotary[0].index_select(0, rows), rotary[1].index_select(0, rows))
            if mask is not None:
                mask = mask.index_select(0, rows)
        kwargs = None if mask is None else {"attention_mask": mask}
        for block in self.blocks[start:stop]:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder,
                                    temb=temb, image_rotary_emb=rotary,
                                    joint_attention_kwargs=kwargs)
        return hidden, encoder
