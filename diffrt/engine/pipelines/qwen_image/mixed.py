"""Qwen-Image over rows of different image sizes in one transformer call.

diffusers' ``QwenImageTransformer2DModel.forward`` builds its rotary
frequencies with ``QwenEmbedRope`` from the *first* row's image shape only
(it warns when the shapes differ and uses the first): one table for the whole
batch, for the image tokens and for the text too — the text's positions start
past the image's largest half side, so they depend on the size as well.
Everything else in it is per row already: the timestep embedding (``temb``)
that modulates each block, and the attention, which masks the text padding.
So ``forward_rows`` is that forward with one change — image and text
frequencies per row, from each row's own ``(1, h/2, w/2)`` — over diffusers'
own modules and weights, and its attention processor (``RowsAttnProcessor``)
is diffusers' ``QwenDoubleStreamAttnProcessor2_0`` with the per-row
frequencies and one key mask for the text padding and the image padding
(``segments.RowLayout``). ControlNet residuals, which diffrt does not pass,
and the edit variants' inputs (``zero_cond_t``, ``use_additional_t_cond``,
``use_layer3d_rope``: the spec leaves such folders to uniform batches) are
left out.

Uniform batches keep diffusers' own forward (``QwenImagePipeline.transformer_forward``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from diffrt.engine.pipelines.qwen_image.joint_attention import joint_outputs, joint_qkv
from diffrt.engine.pipelines.segments import attention_processor, masked_attention

if TYPE_CHECKING:
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.attention_processor import Attention


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen`` (``use_real=False``: pairs as
    complex numbers) with frequencies per row: ``x`` (rows, tokens, heads,
    dim), ``freqs`` complex (rows, tokens, dim / 2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(3).type_as(x)


class RowsAttnProcessor:
    """diffusers' ``QwenDoubleStreamAttnProcessor2_0`` with frequencies per
    row and a key mask over text then image (True: attend), in the processor
    call diffusers' ``Attention`` makes (the mask comes as ``attention_mask``,
    which diffusers' processor refuses because it builds its own from the text
    mask alone). Attention runs through torch's ``scaled_dot_product_attention``."""

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or encoder_hidden_states_mask is not None:
            raise ValueError("mixed-size Qwen-Image attention takes the text stream, "
                             "its mask inside attention_mask")
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states,
                                      image_rotary_emb, rotate)
        out = masked_attention(query, key, value, attention_mask)
        return joint_outputs(attn, out.to(query.dtype), encoder_hidden_states.shape[1])


_ROWS_PROCESSOR = RowsAttnProcessor()


def row_rotary(model: QwenImageTransformer2DModel, shapes: list[list[tuple[int, int, int]]], text_tokens: int,
               longest: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, text) complex frequencies, (rows, longest, dim / 2) and (rows,
    text_tokens, dim / 2): each row's from its own shapes by diffusers'
    ``pos_embed`` (padding positions get no rotation, masked anyway); built
    once per distinct shape."""
    tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    image_rows, text_rows = [], []
    for shape in shapes:
        table = tables.get(tuple(shape))
        if table is None:
            # a batch of one row: pos_embed reads a batch's first row, whose
            # frames (an edit's inputs after the output) it places one after another
            image, text = model.pos_embed([shape], max_txt_seq_len=text_tokens, device=device)
            pad = image.new_ones(longest - image.shape[0], image.shape[1])
            table = tables[tuple(shape)] = (torch.cat([image, pad]), text)
        image_rows.append(table[0])
        text_rows.append(table[1])
    return torch.stack(image_rows), torch.stack(text_rows)


def forward_rows(model: QwenImageTransformer2DModel, *, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 timestep: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                 key_mask: torch.Tensor) -> torch.Tensor:
    """``QwenImageTransformer2DModel.forward`` with frequencies per row and
    the text and image padding in one key mask, (rows, text + longest) (see
    the module); the model's attention processors are ``RowsAttnProcessor``
    while it runs. No guidance input: diffusers' Qwen timestep embedding
    (``QwenTimestepProjEmbeddings``) has none."""
    from diffrt.engine.pipelines.qwen_image.blocks import QwenImageBlocks

    with rows_processor(model):
        blocks = QwenImageBlocks(model, hidden_states=hidden_states,
                                 encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                                 guidance=None, rotary=rotary, key_mask=key_mask)
        return blocks.run_all()


def rows_processor(model: QwenImageTransformer2DModel) -> AbstractContextManager:
    """``RowsAttnProcessor`` in every attention of ``model`` while it is held."""
    return attention_processor(model, _ROWS_PROCESSOR)
