"""Flux over rows of different image sizes in one transformer call.

diffusers' ``FluxTransformer2DModel.forward`` builds one rotary table for the
whole batch from a 2-D ``img_ids``: every row must have the same image
positions, so the same size. Everything else in it is per row already: the
timestep, guidance and pooled-text embeddings (``temb``) that modulate each
block, and the attention, which takes a mask. So ``forward_rows`` is that
forward with one change — a rotary table per row, built from each row's own
``img_ids`` — over diffusers' own modules and weights, and its attention
processor (``RowsAttnProcessor``) is diffusers' ``FluxAttnProcessor`` with
the per-row table and the padding mask (``segments.RowLayout``). ControlNet
residuals and IP-adapter inputs, which diffrt does not pass, are left out.

Uniform batches keep diffusers' own forward (``FluxPipeline.transformer_forward``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from diffrt.engine.pipelines.flux.blocks import FluxBlocks
from diffrt.engine.pipelines.segments import attention_processor, masked_attention

if TYPE_CHECKING:
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux import FluxAttention


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (``use_real``, pairs interleaved) with a
    table per row: ``x`` (rows, tokens, heads, dim), ``cos``/``sin`` (rows, tokens, dim)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class RowsAttnProcessor:
    """diffusers' ``FluxAttnProcessor`` with a rotary table per row and a
    key mask (True: attend), in the processor call diffusers' ``FluxAttention``
    makes. Attention runs through torch's ``scaled_dot_product_attention``."""

    def __call__(self, attn: FluxAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        out = masked_attention(query.transpose(1, 2), key.transpose(1, 2),
                               value.transpose(1, 2), attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        encoder_out, out = out[:, :text], out[:, text:]
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(encoder_out.contiguous())


_ROWS_PROCESSOR = RowsAttnProcessor()


def row_rotary(model: FluxTransformer2DModel, txt_ids: torch.Tensor, img_ids: list[torch.Tensor],
               longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), (rows, text + longest, dim): each row's table from its own
    ``img_ids`` (padding positions get position 0, masked anyway); built once
    per distinct size."""
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    cos_rows, sin_rows = [], []
    for ids in img_ids:
        table = tables.get(id(ids))
        if table is None:
            pad = ids.new_zeros(longest - ids.shape[0], ids.shape[1])
            table = model.pos_embed(torch.cat([txt_ids, ids, pad]))
            tables[id(ids)] = table
        cos_rows.append(table[0])
        sin_rows.append(table[1])
    return torch.stack(cos_rows), torch.stack(sin_rows)


def forward_rows(model: FluxTransformer2DModel, *, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 pooled_projections: torch.Tensor, timestep: torch.Tensor,
                 guidance: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor) -> torch.Tensor:
    """``FluxTransformer2DModel.forward`` with a rotary table per row (see the
    module); the model's attention processors are ``RowsAttnProcessor``
    while it runs."""
    with rows_processor(model):
        blocks = FluxBlocks(model, hidden_states=hidden_states,
                            encoder_hidden_states=encoder_hidden_states,
                            pooled_projections=pooled_projections, timestep=timestep,
                            guidance=guidance, rotary=rotary, attention_mask=attention_mask)
        return blocks.run_all()


def rows_processor(model: FluxTransformer2DModel) -> AbstractContextManager:
    """``RowsAttnProcessor`` in every attention of ``model`` while it is held."""
    return attention_processor(model, _ROWS_PROCESSOR)
