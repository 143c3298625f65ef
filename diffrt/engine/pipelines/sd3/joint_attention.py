"""The projections and outputs of diffusers' SD3 joint attention, shared by
diffrt's processors (``parallel.py``: sequence parallelism; ``mixed.py``: rows
of several sizes): what ``JointAttnProcessor2_0`` does around its attention
call, so the processors differ only in that call."""

from __future__ import annotations

from typing import Any

import torch


def joint_qkv(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
              *, text_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value (rows, heads, tokens, head dim) of the image
    tokens, normed as diffusers norms them, joined with the text's (before or
    after them, ``text_first``) when the call has text (SD3.5's image-only
    second attention has none)."""
    b = hidden_states.shape[0]
    head_dim = attn.to_k.out_features // attn.heads

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(b, -1, attn.heads, head_dim).transpose(1, 2)

    query, key = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states))
    value = heads(attn.to_v(hidden_states))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if encoder_hidden_states is None:
        return query, key, value
    text_q = heads(attn.add_q_proj(encoder_hidden_states))
    text_k = heads(attn.add_k_proj(encoder_hidden_states))
    text_v = heads(attn.add_v_proj(encoder_hidden_states))
    if attn.norm_added_q is not None:
        text_q = attn.norm_added_q(text_q)
    if attn.norm_added_k is not None:
        text_k = attn.norm_added_k(text_k)
    pairs = ((query, text_q), (key, text_k), (value, text_v))
    q, k, v = (torch.cat([t, i] if text_first else [i, t], dim=2) for i, t in pairs)
    return q, k, v


def joint_outputs(attn: Any, out: torch.Tensor, image_tokens: int, *,
                  text_first: bool, has_text: bool) -> Any:
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
