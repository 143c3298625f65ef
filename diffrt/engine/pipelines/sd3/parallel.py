"""diffusers' SD3 joint attention with sequence parallelism.

The same projections and norms as diffusers' ``JointAttnProcessor2_0``; the
text tokens are put first (attention does not depend on the order of its
tokens; the split layers expect text first) and the attention call goes
through the ``SequenceSplit``. SD3 always passes the text apart, so the
text length is known per call; SD3.5's image-only second attention has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.sd3.joint_attention import joint_outputs, joint_qkv

if TYPE_CHECKING:
    from diffusers.models.attention_processor import Attention


class SequenceParallelJointAttnProcessor:
    def __init__(self, sequence: SequenceSplit) -> None:
        self.sequence = sequence

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any,
                 **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("sequence-parallel attention does not take an attention mask")
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states,
                                      text_first=True)
        text_len = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        out = self.sequence.attention(query, key, value, text_len).to(query.dtype)
        return joint_outputs(attn, out, hidden_states.shape[1], text_first=True,
                             has_text=encoder_hidden_states is not None)


__all__ = ["SequenceParallelJointAttnProcessor"]
