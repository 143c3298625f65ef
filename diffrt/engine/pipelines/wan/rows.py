"""Wan's call input per row: the patch embedding and the 3-D rotary table,
for rows of one size or of several (a padded call).

diffusers' ``WanTransformer3DModel.forward`` builds one rotary table per
batch (``WanRotaryPosEmbed`` reads the input's frame count, height and
width): every row must have the same (F, h, w). Everything else in it is
per row already — the time embedding that modulates each block, the cross
attention to each row's text. So rows of several sizes share one call
(``mixed_rows="padded"``) with two changes, over diffusers' own modules and
weights: each row's video tokens are embedded by ``patch_embedding`` at its
own size and zero-padded at the end to the call's longest row, and its
table is built from its own (F, h, w) by the model's ``rope`` (padding
positions get zeros, masked anyway). The self-attention masks the padding
out as keys (``RowsAttnProcessor``: diffusers' ``WanAttnProcessor`` with
the key mask, through ``segments.masked_attention``); a padded query's
output is never read (``split_predictions`` cuts each row back).

The mask travels beside the table as the blocks' ``rotary_emb`` argument,
(cos, sin, mask): diffusers' block hands that argument to its
self-attention only, and a step cache's sub-batch narrows all three by row
(``cache.forward.rows_of``). ``mixed_rows="packed"`` runs as padded here
(Wan has no packed forward); ``by_size`` (the CPU default) is a call per size.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.pipelines.segments import RowLayout, attention_processor, masked_attention

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanAttention

#: the blocks' ``rotary_emb``: (cos, sin) shared by every row, (1, tokens, 1,
#: dim); or (cos, sin, key mask) per row, (rows, longest, 1, dim) and (rows, longest)
Rotary = tuple[torch.Tensor, ...]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan ``apply_rotary_emb`` (pairs interleaved); ``cos``/``sin``
    broadcast over ``x``'s (rows, tokens, heads, dim)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class RowsAttnProcessor:
    """diffusers' ``WanAttnProcessor`` where the self-attention's
    ``rotary_emb`` carries a key mask (see the module); any other call (the
    cross-attention, a table without a mask) is diffusers' own processor's."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.plain = WanAttnProcessor()

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: Rotary | None = None) -> torch.Tensor:
        if rotary_emb is None or len(rotary_emb) != 3 or encoder_hidden_states is not None:
            return self.plain(attn, hidden_states, encoder_hidden_states, attention_mask,
                              rotary_emb)
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        cos, sin, mask = rotary_emb
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        out = masked_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               mask)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class VideoRows:
    """A call's rows as the transformer takes them (see the module): the
    5-D input of each size with the call's rows it holds, and the rotary
    table (shared, or per row with the key mask), built when first read by
    ``rope`` (the model's: under model offload, that of an expert the call runs)."""

    def __init__(self, groups: list[tuple[torch.Tensor, torch.Tensor | None]],
                 tokens: tuple[int, ...], rope: torch.nn.Module):
        #: (rows of one size, (g, C, F, h, w); their rows in the call, None: all)
        self.groups = groups
        self.tokens = tokens
        self.rows = len(tokens)
        self.longest = max(tokens)
        self.padded = len(groups) > 1
        self.rope = rope

    @functools.cached_property
    def rotary(self) -> Rotary:
        """The blocks' ``rotary_emb`` for every row of the call."""
        if not self.padded:
            return self.rope(self.groups[0][0])
        cos = sin = None
        for x, at in self.groups:
            c, s = self.rope(x)  # (1, n, 1, dim): each size's own positions
            if cos is None or sin is None:
                shape = (self.rows, self.longest, *c.shape[2:])
                cos, sin = c.new_zeros(shape), s.new_zeros(shape)
            assert at is not None  # several sizes: each group its rows
            cos[at, :c.shape[1]] = c[0]
            sin[at, :s.shape[1]] = s[0]
        assert cos is not None and sin is not None
        lengths = torch.tensor(self.tokens, device=cos.device)
        mask = torch.arange(self.longest, device=cos.device)[None, :] < lengths[:, None]
        return (cos, sin, mask)

    @staticmethod
    def of(x_tokens: torch.Tensor, extra: torch.Tensor, layout: RowLayout, latents: Any,
           rope: torch.nn.Module) -> VideoRows:
        """The rows of ``x_tokens`` (rows, tokens, dim), each unpacked at its
        size (``latents``: the family's ``VideoLatents``), an image-to-video
        row's condition channels (``extra``) beside its latents."""
        by_size: dict[tuple[int, ...], list[int]] = {}
        for row, size in enumerate(layout.sizes):
            by_size.setdefault(size, []).append(row)
        groups: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for size, members in by_size.items():
            n = latents.tokens(size)
            at = None if len(by_size) == 1 else torch.tensor(members, device=x_tokens.device)
            mine = [(t if at is None else t.index_select(0, at))[:, :n]
                    for t in (x_tokens, extra)]
            x = latents.unpack(mine[0], size)
            if extra.shape[-1]:  # image-to-video: mask and first-frame channels
                x = torch.cat([x, latents.unpack(mine[1], size)], dim=1)
            groups.append((x, at))
        return VideoRows(groups, layout.tokens, rope)

    def embed(self, model: WanTransformer3DModel, rows: torch.Tensor | None) -> torch.Tensor:
        """``model``'s patch embedding of the call's ``rows`` (None: all),
        (rows, longest, dim), each row's tokens first, zeros after."""
        def patches(x: torch.Tensor) -> torch.Tensor:
            return model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()

        if not self.padded:
            x = self.groups[0][0]
            return patches(x if rows is None else x.index_select(0, rows))
        wanted = torch.arange(self.rows, device=self.groups[0][0].device) if rows is None else rows
        out: torch.Tensor | None = None
        for x, at in self.groups:
            assert at is not None
            hit = (wanted[:, None] == at[None, :])  # (wanted, group): the same row
            mine = hit.any(dim=1).nonzero().squeeze(1)
            if not len(mine):
                continue
            h = patches(x.index_select(0, hit[mine].float().argmax(dim=1)))
            if out is None:
                out = h.new_zeros(len(wanted), self.longest, h.shape[-1])
            out[mine, :h.shape[1]] = h
        assert out is not None  # a call has rows
        return out

    def rotary_of(self, rows: torch.Tensor | None) -> Rotary:
        """The blocks' ``rotary_emb`` for the call's ``rows`` (None: all)."""
        if rows is None or not self.padded:
            return self.rotary
        return tuple(part.index_select(0, rows) for part in self.rotary)


@contextlib.contextmanager
def rows_processors(models: list[Any], padded: bool) -> Iterator[None]:
    """``RowsAttnProcessor`` in every attention of ``models`` while held
    (a padded call's); nothing for rows of one size."""
    with contextlib.ExitStack() as stack:
        if padded:
            processor = RowsAttnProcessor()
            for model in models:
                stack.enter_context(attention_processor(model, processor))
        yield


__all__ = ["RowsAttnProcessor", "VideoRows", "rotate", "rows_processors"]
