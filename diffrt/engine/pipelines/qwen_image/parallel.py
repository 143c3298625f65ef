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

from typing import TYPE_CHECKING, cast

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
from torch import nn

from diffrt.engine.parallel.sequence import GatherTokens, SequenceSplit
from diffrt.engine.pipelines.qwen_image.joint_attention import joint_outputs, joint_qkv

if TYPE_CHECKING:
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.attention_processor import Attention


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # with use_real=False it returns one tensor; diffusers annotates the pair
    # that use_real=True returns
    return cast(torch.Tensor, apply_rotary_emb_qwen(x, freqs, use_real=False))


class SequenceParallelQwenAttnProcessor:
    def __init__(self, sequence: SequenceSplit) -> None:
        self.sequence = sequence

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("Qwen-Image attention takes the text stream and no external mask")
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states,
                                      image_rotary_emb, _rotate)
        text_len = encoder_hidden_states.shape[1]
        out = self.sequence.attention(query, key, value, text_len)
        return joint_outputs(attn, out.to(query.dtype), text_len)


class ShardRotary(nn.Module):
    """Wraps the rotary embedding: this rank's rows of the image frequencies
    (the text's whole) while the call is split."""

    def __init__(self, inner: nn.Module, sequence: SequenceSplit) -> None:
        super().__init__()
        self.inner, self.sequence = inner, sequence

    def forward(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        image, text = self.inner(*args, **kwargs)
        return self.sequence.shard(image, 0), text


def enable_qwen_sequence_parallel(transformer: QwenImageTransformer2DModel,
                                  sequence: SequenceSplit) -> None:
    transformer.set_attn_processor(SequenceParallelQwenAttnProcessor(sequence))
    transformer.pos_embed = ShardRotary(transformer.pos_embed, sequence)
    transformer.proj_out = GatherTokens(transformer.proj_out, sequence)


__all__ = ["SequenceParallelQwenAttnProcessor", "ShardRotary", "enable_qwen_sequence_parallel"]
