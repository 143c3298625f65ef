"""Flux over *packed* rows: every row's tokens in one sequence, nothing padded.

diffusers' Flux blocks modulate per row — ``AdaLayerNormZero`` scales and
shifts a (rows, tokens, dim) tensor by one (rows, dim) vector each — so a
sequence holding several rows' tokens needs its modulation per token. This
module is diffusers' ``FluxTransformer2DModel.forward`` and its two block
forwards written over packed (tokens, dim) streams, diffusers' own modules
and weights throughout: each block's modulation vectors are computed per
row, as there, and gathered to the tokens of their row; the text stream and
the image stream stay apart as in the double-stream blocks, and attention
runs over each row's [text, image] tokens alone (``packed_attention``: the
platform's variable-length attention, else torch's SDPA a row at a time).

``mixed_rows="packed"``: measured on CPU against the padded call and the
call per size (``pipelines.segments``); not the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from diffrt.engine.pipelines.segments import RowLayout

if TYPE_CHECKING:
    from diffusers import FluxTransformer2DModel
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
    from diffusers.models.transformers.transformer_flux import (
        FluxAttention,
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     starts: list[int]) -> torch.Tensor:
    """Attention of sequences packed one after another, (tokens, heads, dim),
    sequence ``i`` being tokens ``starts[i]:starts[i + 1]``."""
    from diffrt.platforms import current_platform

    varlen = current_platform.varlen_attention(q.dtype)
    if varlen is not None:
        offsets = torch.tensor(starts, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
        return varlen(q, k, v, offsets, longest)
    def row(x: torch.Tensor, a: int, b: int) -> torch.Tensor:  # (1, heads, tokens, dim)
        return x[a:b].transpose(0, 1)[None]

    return torch.cat([F.scaled_dot_product_attention(row(q, a, b), row(k, a, b), row(v, a, b))[0]
                      .transpose(0, 1) for a, b in zip(starts, starts[1:], strict=False)])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (``use_real``, pairs interleaved) with a
    table per token: ``x`` (tokens, heads, dim), ``cos``/``sin`` (tokens, dim)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _modulation(norm: AdaLayerNormZero | AdaLayerNormZeroSingle, temb: torch.Tensor, rows: torch.Tensor, parts: int
                ) -> tuple[torch.Tensor, ...]:
    """A block norm's modulation vectors, computed per row as diffusers
    computes them and gathered to each token's row: (tokens, dim) each."""
    return norm.linear(norm.silu(temb))[rows].chunk(parts, dim=-1)


class _Packing:
    """Where each row's tokens sit: the text stream (rows x text tokens), the
    image stream (each row's real image tokens), and the joint order that
    puts each row's text before its image tokens, one row after another."""

    def __init__(self, layout: RowLayout, text_tokens: int, device: torch.device):
        rows, longest = len(layout), layout.longest
        self.text_rows = torch.arange(rows, device=device).repeat_interleave(text_tokens)
        mask = torch.arange(longest, device=device)[None, :] < torch.tensor(
            layout.tokens, device=device)[:, None]
        #: the image tokens' positions in the padded (rows x longest) layout
        self.image_index = mask.reshape(-1).nonzero().squeeze(1)
        self.image_rows = self.image_index // longest
        text_count = rows * text_tokens
        order, starts, image_start = [], [0], 0
        for row, tokens in enumerate(layout.tokens):
            order.append(torch.arange(row * text_tokens, (row + 1) * text_tokens, device=device))
            order.append(text_count + image_start + torch.arange(tokens, device=device))
            image_start += tokens
            starts.append(starts[-1] + text_tokens + tokens)
        #: joint position -> position in cat([text stream, image stream])
        self.order = torch.cat(order)
        self.starts = starts
        self.text_count = text_count
        self.joint_rows = torch.cat([self.text_rows, self.image_rows])[self.order]

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return torch.cat([text, image])[self.order]

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty_like(joint)
        both[self.order] = joint
        return both[:self.text_count], both[self.text_count:]


def _qkv(attn: FluxAttention, x: torch.Tensor, added: bool
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads = (-1, attn.head_dim)
    if added:
        q, k, v = attn.add_q_proj(x), attn.add_k_proj(x), attn.add_v_proj(x)
        return (attn.norm_added_q(q.unflatten(-1, heads)), attn.norm_added_k(k.unflatten(-1, heads)),
                v.unflatten(-1, heads))
    q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    return attn.norm_q(q.unflatten(-1, heads)), attn.norm_k(k.unflatten(-1, heads)), v.unflatten(-1, heads)


def _attend(pack: _Packing, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rotary
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return packed_attention(q, k, v, pack.starts).flatten(1).to(q.dtype)


def _double_block(block: FluxTransformerBlock, pack: _Packing, image: torch.Tensor, text: torch.Tensor,
                  temb: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` over the packed streams."""
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = _modulation(
        block.norm1, temb, pack.image_rows, 6)
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(
        block.norm1_context, temb, pack.text_rows, 6)
    norm_image = block.norm1.norm(image) * (1 + scale) + shift
    norm_text = block.norm1_context.norm(text) * (1 + c_scale) + c_shift
    attn = block.attn
    (iq, ik, iv), (tq, tk, tv) = _qkv(attn, norm_image, False), _qkv(attn, norm_text, True)
    out = _attend(pack, pack.join(tq, iq), pack.join(tk, ik), pack.join(tv, iv), rotary)
    text_out, image_out = pack.split(out)
    image = image + gate * attn.to_out[1](attn.to_out[0](image_out))
    image = image + gate_mlp * block.ff(block.norm2(image) * (1 + scale_mlp) + shift_mlp)
    text = text + c_gate * attn.to_add_out(text_out)
    text = text + c_gate_mlp * block.ff_context(
        block.norm2_context(text) * (1 + c_scale_mlp) + c_shift_mlp)
    if text.dtype == torch.float16:
        text = text.clip(-65504, 65504)
    return image, text


def _single_block(block: FluxSingleTransformerBlock, pack: _Packing, joint: torch.Tensor, temb: torch.Tensor,
                  rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``FluxSingleTransformerBlock.forward`` over the joint packed stream."""
    shift, scale, gate = _modulation(block.norm, temb, pack.joint_rows, 3)
    normed = block.norm.norm(joint) * (1 + scale) + shift
    mlp = block.act_mlp(block.proj_mlp(normed))
    out = _attend(pack, *_qkv(block.attn, normed, False), rotary)
    joint = joint + gate * block.proj_out(torch.cat([out, mlp], dim=-1))
    return joint.clip(-65504, 65504) if joint.dtype == torch.float16 else joint


def forward_packed(model: FluxTransformer2DModel, *, hidden_states: torch.Tensor, layout: RowLayout,
                   encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor,
                   timestep: torch.Tensor, guidance: torch.Tensor | None,
                   rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``FluxTransformer2DModel.forward`` over packed rows (see the module):
    ``hidden_states`` and ``rotary`` in the padded layout the pipeline builds
    ((rows, longest, ...) and (rows, text + longest, dim)); the output too,
    zero past each row's tokens."""
    rows, longest, channels = hidden_states.shape
    text_tokens = encoder_hidden_states.shape[1]
    pack = _Packing(layout, text_tokens, hidden_states.device)
    image = model.x_embedder(hidden_states.reshape(rows * longest, channels)[pack.image_index])
    timestep = timestep.to(image.dtype) * 1000
    if guidance is None:
        temb = model.time_text_embed(timestep, pooled_projections)
    else:
        temb = model.time_text_embed(timestep, guidance.to(image.dtype) * 1000, pooled_projections)
    text = model.context_embedder(encoder_hidden_states.reshape(rows * text_tokens, -1))
    def per_token(table: torch.Tensor) -> torch.Tensor:  # (rows, text + longest, d) -> joint
        flat = table[:, text_tokens:].reshape(-1, table.shape[-1])[pack.image_index]
        return pack.join(table[:, :text_tokens].reshape(-1, table.shape[-1]), flat)

    joint_rotary = (per_token(rotary[0]), per_token(rotary[1]))
    for block in model.transformer_blocks:
        image, text = _double_block(block, pack, image, text, temb, joint_rotary)
    joint = pack.join(text, image)
    for block in model.single_transformer_blocks:
        joint = _single_block(block, pack, joint, temb, joint_rotary)
    _, image = pack.split(joint)
    emb = model.norm_out.linear(model.norm_out.silu(temb).to(image.dtype))
    scale, shift = emb.chunk(2, dim=1)
    image = model.norm_out.norm(image) * (1 + scale[pack.image_rows]) + shift[pack.image_rows]
    out = model.proj_out(image)
    padded = out.new_zeros(rows * longest, out.shape[-1])
    padded[pack.image_index] = out
    return padded.view(rows, longest, -1)
