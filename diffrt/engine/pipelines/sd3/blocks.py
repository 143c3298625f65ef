"""SD3's transformer call cut at its blocks (``engine.cache.forward``).

The operations of diffusers' ``SD3Transformer2DModel.forward`` in its order
— the patch embedding, the joint blocks, the output norm and projection —
over diffusers' own modules, so running every block over every row gives
diffusers' bits. The prediction stays in patch tokens (``patches.py``'s
layout: diffusers' unpatchify and diffrt's patchify only move values). In a
mixed-size call each size is embedded apart and padded (``embed_patches``;
``mixed.py``'s processor, with the padding mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffrt.engine.cache.forward import TransformerBlocks
from diffrt.engine.pipelines.sd3.patches import unpatchify
from diffrt.engine.pipelines.segments import RowLayout

if TYPE_CHECKING:
    from diffusers import SD3Transformer2DModel


def embed_patches(model: SD3Transformer2DModel, latents: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """(rows, longest, inner dim): each size's rows through the model's
    ``pos_embed`` (convolution + that size's cropped positions), at the
    start of their rows; the padding zero."""
    patch = model.config.patch_size
    out: torch.Tensor | None = None
    for size in dict.fromkeys(layout.sizes):  # each size once, in row order
        index = [i for i, s in enumerate(layout.sizes) if s == size]
        tokens = layout.tokens[index[0]]
        rows = torch.tensor(index, device=latents.device)
        embedded = model.pos_embed(unpatchify(latents[rows, :tokens], size, patch))
        if out is None:
            out = embedded.new_zeros(len(layout), layout.longest, embedded.shape[-1])
        out[rows, :tokens] = embedded
    assert out is not None  # a call has rows
    return out


class SD3Blocks(TransformerBlocks):
    """See the module; ``hidden_states`` are patch tokens (rows, longest, p·p·C)."""

    def __init__(self, model: SD3Transformer2DModel, *, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor,
                 timestep: torch.Tensor, layout: RowLayout):
        self.model = model
        if layout.uniform:  # diffusers' own: spatial latents through pos_embed
            spatial = unpatchify(hidden_states, layout.sizes[0], model.config.patch_size)
            self.hidden = model.pos_embed(spatial).contiguous()
            self.mask = None
        else:
            self.hidden = embed_patches(model, hidden_states, layout)
            self.mask = layout.key_mask(0, self.hidden.device)  # image keys: the text's appended
        self.temb = model.time_text_embed(timestep, pooled_projections)
        self.encoder = model.context_embedder(encoder_hidden_states)
        self.blocks = list(model.transformer_blocks)
        self.count = len(self.blocks)
        self.row_inputs = {"temb": self.temb, **self.attention_inputs(self.mask)}
        self.shared_inputs = {} if self.mask is not None else {"joint_attention_kwargs": None}
