"""The projections and outputs of diffusers' SD3 joint attention, shared by
diffrt's processors (``parallel.py``: sequence parallelism; ``mixed.py``: rows
of several sizes): what ``JointAttnProcessor2_0`` does around its attention
call, so the processors differ only in that call. Each stream's
projections are ``attention_streams.stream_qkv``, as Qwen-Image's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffrt.engine.pipelines.attention_streams import stream_qkv

if TYPE_CHECKING:
    from diffusers.models.attention_processor import Attention


def joint_qkv(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
              *, text_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value (rows, heads, tokens, head dim) of the image
    tokens, normed as diffusers norms them, joined with the text's (before or
    after them, ``text_first``) when the call has text (SD3.5's image-only
    second attention has none)."""
    query, key, value = (x.transpose(1, 2) for x in stream_qkv(attn, hidden_states))
    if encoder_hidden_states is None:
        return query, key, value
    text_q, text_k, text_v = (x.transpose(1, 2)
                              for x in stream_qkv(attn, encoder_hidden_states, text=True))
    pairs = ((query, text_q), (key, text_k), (value, text_v))
    q, k, v = (torch.cat([t, i] if text_first else [i, t], dim=2) for i, t in pairs)
    return q, k, v


def joint_outputs(attn: Attention, out: torch.Tensor, image_tokens: int, *,
                  text_first: bool, has_text: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The attention's output (rows, heads, tokens, head dim) through the
    output projections: the image tokens', and the text's when the call had
    text (projected unless the block is ``context_pre_only``)."""
    b = out.shape[0]
    out = out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[3])
    if text_first:
        text, image = out[:, :out.shape[1] - image_tokens], out[:, out.shape[1] - image_tokens:]
    else:
        image, text = out[:, :image_tokens], out[:, image_tokens:]
    image = attn.to_out[1](attn.to_out[0](image))
    if not has_text:
        return image
    if not attn.context_pre_only:
        text = attn.to_add_out(text)
    return image, text
