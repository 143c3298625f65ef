"""One stream's query, key and value as diffusers' joint attentions make
them: the projections (``to_q``/``to_k``/``to_v`` for the image stream,
``add_q_proj``/... for the text stream) split into heads and, where the
attention has them, the q/k norms. SD3's ``JointAttnProcessor2_0`` and
Qwen-Image's ``QwenDoubleStreamAttnProcessor2_0`` both begin so, and each
family's ``joint_attention.py`` joins the streams its way (SD3: image
first; Qwen-Image: rotated, text first), so this is written once."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class JointAttentionModule(Protocol):
    """What a diffusers joint attention module holds (``Attention``,
    ``QwenAttention``…): its projections and optional norms."""

    heads: int
    to_q: nn.Module
    to_k: nn.Module
    to_v: nn.Module
    add_q_proj: nn.Module
    add_k_proj: nn.Module
    add_v_proj: nn.Module
    norm_q: nn.Module | None
    norm_k: nn.Module | None
    norm_added_q: nn.Module | None
    norm_added_k: nn.Module | None


def stream_qkv(attn: JointAttentionModule, x: torch.Tensor, *, text: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value of ``x``, (rows, tokens, heads, head dim), the
    query and key normed: the text stream's projections when ``text``."""
    if text:
        projections, norms = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), (
            attn.norm_added_q, attn.norm_added_k)
    else:
        projections, norms = (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
    q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)) for proj in projections)
    if norms[0] is not None:
        q = norms[0](q)
    if norms[1] is not None:
        k = norms[1](k)
    return q, k, v


__all__ = ["JointAttentionModule", "stream_qkv"]
