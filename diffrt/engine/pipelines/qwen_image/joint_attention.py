"""The projections and outputs of diffusers' Qwen-Image double-stream
attention, shared by diffrt's processors (``parallel.py``: sequence
parallelism; ``mixed.py``: rows of several sizes): what
``QwenDoubleStreamAttnProcessor2_0`` does around its attention call, so the
processors differ only in their rotary embedding and that call. Each
stream's projections are ``attention_streams.stream_qkv``, as SD3's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from diffrt.engine.pipelines.attention_streams import stream_qkv

if TYPE_CHECKING:
    from diffusers.models.attention_processor import Attention

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def joint_qkv(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
              image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None, rotate: Rotate
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value (rows, heads, tokens, head dim), text first and
    then image as diffusers joins them, each stream projected and normed as
    there and rotated by ``rotate(x, freqs)`` with its frequencies
    (``image_rotary_emb``: (image, text), or None)."""
    img_q, img_k, img_v = stream_qkv(attn, hidden_states)
    txt_q, txt_k, txt_v = stream_qkv(attn, encoder_hidden_states, text=True)
    if image_rotary_emb is not None:
        img_freqs, txt_freqs = image_rotary_emb
        img_q, img_k = rotate(img_q, img_freqs), rotate(img_k, img_freqs)
        txt_q, txt_k = rotate(txt_q, txt_freqs), rotate(txt_k, txt_freqs)
    q, k, v = (torch.cat([t, i], dim=1).transpose(1, 2)
               for t, i in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
    return q, k, v


def joint_outputs(attn: Attention, out: torch.Tensor, text_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's output (rows, heads, tokens, head dim) through the
    output projections: (image, text)."""
    out = out.transpose(1, 2).flatten(2, 3)
    image = attn.to_out[0](out[:, text_tokens:].contiguous())
    if len(attn.to_out) > 1:
        image = attn.to_out[1](image)  # dropout
    return image, attn.to_add_out(out[:, :text_tokens].contiguous())
