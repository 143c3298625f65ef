"""diffusers' Flux attention with sequence parallelism (Ulysses, ring, both).

The same projections, norms and rotary embedding as diffusers'
``FluxAttnProcessor``; only the attention call changes, to the
``SequenceSplit``'s. The pipeline sets ``sequence.text_len`` before each
transformer call (single-stream blocks receive text and image tokens
already concatenated, so the processor cannot tell them apart).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.models.embeddings import apply_rotary_emb

from diffrt.engine.parallel.sequence import SequenceSplit

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_flux import FluxAttention


class SequenceParallelFluxAttnProcessor:
    def __init__(self, sequence: SequenceSplit) -> None:
        self.sequence = sequence

    def __call__(self, attn: FluxAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("sequence-parallel attention does not take an attention mask")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None:  # double-stream block: text projected apart
            query = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))),
                               query], dim=1)
            key = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))),
                             key], dim=1)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.sequence.attention(query.transpose(1, 2), key.transpose(1, 2),
                                   value.transpose(1, 2), self.sequence.text_len)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text, image = out.split_with_sizes(
            [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


__all__ = ["SequenceParallelFluxAttnProcessor"]
