"""SD3 over rows of different image sizes in one transformer call.

diffusers' ``SD3Transformer2DModel.forward`` takes spatial latents (N, C, h,
w): its patch embedding (``PatchEmbed``: a stride-``p`` convolution plus the
positional embedding cropped to the image's size) and its unpatchify need
one size per batch, and its attention processor (``JointAttnProcessor2_0``)
ignores ``attention_mask``. Everything between is per token or per row
already (the timestep and pooled-text modulation, the norms and
feed-forwards). So ``forward_rows`` is that forward with two changes, over
diffusers' own modules and weights:

- the patch embedding runs once per size, on that size's rows, through the
  model's own ``pos_embed`` (the same convolution and cropped positions
  diffusers would apply to a batch of that size), and its tokens are
  zero-padded to the call's longest row (``blocks.embed_patches``);
- the attention processor (``RowsJointAttnProcessor``) is diffusers'
  ``JointAttnProcessor2_0`` with the padding masked out as keys.

The output stays tokens: ``proj_out`` gives each token's patch in the
layout of ``patches.py``, what the pipeline's latents are. SD3.5's
dual-attention blocks need nothing more: the block passes the same
``attention_mask`` to its image-only second attention (``attn2``), which the
processor masks without the text. ControlNet residuals, skipped layers and
IP-adapter inputs, which diffrt does not pass, are left out.

Uniform batches keep diffusers' own forward (``SD3Pipeline.transformer_forward``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from diffrt.engine.pipelines.sd3.joint_attention import joint_outputs, joint_qkv
from diffrt.engine.pipelines.segments import RowLayout, attention_processor, masked_attention

if TYPE_CHECKING:
    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention_processor import Attention


class RowsJointAttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` with a key mask over the image
    tokens, ``attention_mask`` (rows, image tokens), True: attend. Its joint
    sequence is [image, text], so text keys (all real) are appended as True;
    the image-only attention (``encoder_hidden_states`` None) takes the mask
    as it is."""

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states,
                                      text_first=False)
        mask = attention_mask
        if mask is not None and encoder_hidden_states is not None:  # text keys: all real
            mask = F.pad(mask, (0, encoder_hidden_states.shape[1]), value=True)
        out = masked_attention(query, key, value, mask).to(query.dtype)
        return joint_outputs(attn, out, hidden_states.shape[1], text_first=False,
                             has_text=encoder_hidden_states is not None)


_ROWS_PROCESSOR = RowsJointAttnProcessor()


def forward_rows(model: SD3Transformer2DModel, *, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 pooled_projections: torch.Tensor, timestep: torch.Tensor,
                 layout: RowLayout) -> torch.Tensor:
    """``SD3Transformer2DModel.forward`` over rows of several sizes (see the
    module): ``hidden_states`` (rows, longest, p·p·C) token-layout latents,
    each row zero-padded after its own tokens; the prediction in the same
    layout. The model's attention processors are ``RowsJointAttnProcessor``
    while it runs."""
    from diffrt.engine.pipelines.sd3.blocks import SD3Blocks

    with rows_processor(model):
        blocks = SD3Blocks(model, hidden_states=hidden_states,
                           encoder_hidden_states=encoder_hidden_states,
                           pooled_projections=pooled_projections, timestep=timestep,
                           layout=layout)
        return blocks.run_all()


def rows_processor(model: SD3Transformer2DModel) -> AbstractContextManager:
    """``RowsJointAttnProcessor`` in every attention of ``model`` while it is held."""
    return attention_processor(model, _ROWS_PROCESSOR)
