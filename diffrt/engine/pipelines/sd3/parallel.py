"""diffusers' SD3 joint attention with sequence parallelism.

The same projections and norms as diffusers' ``JointAttnProcessor2_0``; the
text tokens are put first (attention does not depend on the order of its
tokens; the split layers expect text first) and the attention call goes
through the ``SequenceSplit``. SD3 always passes the text apart, so the
text length is known per call; SD3.5's image-only second attention has none.
"""

from __future__ import annotations

from typing import Any

import torch

from diffrt.engine.parallel.sequence import SequenceSplit


class SequenceParallelJointAttnProcessor:
    def __init__(self, sequence: SequenceSplit) -> None:
        self.sequence = sequence

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args: Any,
                 **kwargs: Any) -> Any:
        if attention_mask is not None:
            raise ValueError("sequence-parallel attention does not take an attention mask")
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
        text_len = 0
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            tq, tk = heads(attn.add_q_proj(encoder_hidden_states)), heads(
                attn.add_k_proj(encoder_hidden_states))
            tv = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                tq = attn.norm_added_q(tq)
            if attn.norm_added_k is not None:
                tk = attn.norm_added_k(tk)
            query, key = torch.cat([tq, query], dim=2), torch.cat([tk, key], dim=2)
            value = torch.cat([tv, value], dim=2)
        out = self.sequence.attention(query, key, value, text_len)
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * head_dim).to(query.dtype)
        text, image = out[:, :text_len], out[:, text_len:]
        image = attn.to_out[1](attn.to_out[0](image))
        if encoder_hidden_states is None:
            return image
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return image, text


__all__ = ["SequenceParallelJointAttnProcessor"]
