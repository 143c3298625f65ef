"""Qwen-Image's transformer call cut at its blocks (``engine.cache.forward``).

The operations of diffusers' ``QwenImageTransformer2DModel.forward`` in its
order — the image and text input projections, the timestep embedding, the
rotary frequencies, the double-stream blocks, the output norm and
projection — over diffusers' own modules, so running every block over every
row gives diffusers' bits. A uniform call keeps diffusers' processor (the
text mask as diffusers builds it, one frequency table); a mixed-size call
has frequencies per row and one key mask (``mixed.py``'s processor).
Checkpoints with ``zero_cond_t`` (edit 2511) are not cut: their spec serves
no cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffrt.engine.cache.forward import TransformerBlocks

if TYPE_CHECKING:
    from diffusers import QwenImageTransformer2DModel


class QwenImageBlocks(TransformerBlocks):
    """See the module. Uniform: ``img_shapes`` and ``text_mask`` (None: no
    padding) as diffusers takes them; mixed: ``rotary`` per row and
    ``key_mask`` (rows, text + longest)."""

    def __init__(self, model: QwenImageTransformer2DModel, *, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                 guidance: torch.Tensor | None, img_shapes: list[list[tuple[int, int, int]]] | None = None,
                 text_mask: torch.Tensor | None = None,
                 rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                 key_mask: torch.Tensor | None = None):
        from diffusers.models.transformers.transformer_qwenimage import (
            compute_text_seq_len_from_mask,
        )

        self.model = model
        self.hidden = model.img_in(hidden_states)
        timestep = timestep.to(self.hidden.dtype)
        encoder = model.txt_in(model.txt_norm(encoder_hidden_states))
        self.encoder = encoder
        if guidance is None:
            self.temb = model.time_text_embed(timestep, self.hidden)
        else:
            self.temb = model.time_text_embed(timestep, guidance.to(self.hidden.dtype) * 1000,
                                              self.hidden)
        self.key_mask = key_mask
        if rotary is None:  # uniform: diffusers' text mask and frequency table
            text_len, _, self.text_mask = compute_text_seq_len_from_mask(encoder, text_mask)
            self.rotary = model.pos_embed(img_shapes, max_txt_seq_len=text_len,
                                          device=self.hidden.device)
            self.per_row = False
        else:
            self.text_mask, self.rotary, self.per_row = None, rotary, True
        self.blocks = list(model.transformer_blocks)
        self.count = len(self.blocks)
        self.row_inputs = {"temb": self.temb, **self.attention_inputs(key_mask)}
        self.shared_inputs = {"encoder_hidden_states_mask": None}
        if self.text_mask is not None:
            self.row_inputs["encoder_hidden_states_mask"] = self.text_mask
        if self.per_row:
            self.row_inputs["image_rotary_emb"] = self.rotary
        else:
            self.shared_inputs["image_rotary_emb"] = self.rotary
        if key_mask is None:
            self.shared_inputs["joint_attention_kwargs"] = None

    def modulated_input(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The first block's image stream after its norm and modulation
        (``img_mod``'s first half, as the block computes it)."""
        block = self.blocks[0]
        temb = self.temb if rows is None else self.temb.index_select(0, rows)
        modulation = block.img_mod(temb).chunk(2, dim=-1)[0]
        return block._modulate(block.img_norm1(hidden), modulation)[0]
