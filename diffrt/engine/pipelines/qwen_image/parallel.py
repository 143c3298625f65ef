"""diffusers' Qwen-Image attention with sequence parallelism.

The same projections, q/k norms and rotary embedding as diffusers'
``QwenDoubleStreamAttnProcessor2_0`` (text first, then image, as there);
the attention call goes through the ``SequenceSplit``, with the text mask
when a batch pads prompts of different lengths. The transformer's rotary
embedding (``pos_embed``) is wrapped so each rank gets its image tokens'
rows of it, and its last projection (``proj_out``) so the output is
gathered; the pipeline splits the image tokens before the call.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
from torch import nn

from diffrt.engine.parallel.sequence import GatherTokens, SequenceSplit


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # with use_real=False it returns one tensor; diffusers annotates the pair
    # that use_real=True returns
    return cast(torch.Tensor, apply_rotary_emb_qwen(x, freqs, use_real=False))


class SequenceParallelQwenAttnProcessor:
    def __init__(self, sequence: SequenceSplit) -> None:
        self.sequence = sequence

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None) -> Any:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("Qwen-Image attention takes the text stream and no external mask")
        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states))
        img_v = heads(attn.to_v(hidden_states))
        txt_q = heads(attn.add_q_proj(encoder_hidden_states))
        txt_k = heads(attn.add_k_proj(encoder_hidden_states))
        txt_v = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q, img_k = _rotate(img_q, img_freqs), _rotate(img_k, img_freqs)
            txt_q, txt_k = _rotate(txt_q, txt_freqs), _rotate(txt_k, txt_freqs)
        text_len = encoder_hidden_states.shape[1]
        query, key, value = (torch.cat([t, i], dim=1).transpose(1, 2)
                             for t, i in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        out = self.sequence.attention(query, key, value, text_len)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        image = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)
        return image, attn.to_add_out(out[:, :text_len].contiguous())


class ShardRotary(nn.Module):
    """Wraps the rotary embedding: this rank's rows of the image frequencies
    (the text's whole) while the call is split."""

    def __init__(self, inner: nn.Module, sequence: SequenceSplit) -> None:
        super().__init__()
        self.inner, self.sequence = inner, sequence

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        image, text = self.inner(*args, **kwargs)
        return self.sequence.shard(image, 0), text


def enable_qwen_sequence_parallel(transformer: Any, sequence: SequenceSplit) -> None:
    transformer.set_attn_processor(SequenceParallelQwenAttnProcessor(sequence))
    transformer.pos_embed = ShardRotary(transformer.pos_embed, sequence)
    transformer.proj_out = GatherTokens(transformer.proj_out, sequence)


__all__ = ["SequenceParallelQwenAttnProcessor", "ShardRotary", "enable_qwen_sequence_parallel"]
