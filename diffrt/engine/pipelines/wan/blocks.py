"""Wan's transformer call cut at its blocks (``engine.cache.forward``).

The operations of diffusers' ``WanTransformer3DModel.forward`` in its order
— the rotary table, the patch embedding, the condition embedder (time and
text), the blocks, the output norm and projection — over diffusers' own
modules, so running every block over every row gives diffusers' bits. The
prediction stays in patch tokens: ``proj_out``'s tokens are the row layout
``latents.py`` packs (diffusers' unpatchify only moves them).

Wan 2.2's two experts: each row runs the expert its timestep falls to (the
pipeline's ``expert_rows``), its embeddings, blocks and head that expert's;
a request's rows share a timestep, so a request is on one expert per step
and its cache's residual is that expert's. A sub-batch over rows of both
experts runs each expert's blocks over its own rows.

TeaCache's signal on Wan is the time embedding ``temb`` (diffusers'
``condition_embedder``'s first output, the ``e`` of the TeaCache authors'
TeaCache4Wan2.1), which their published polynomials were fitted on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from diffrt.engine.cache.forward import TransformerBlocks
from diffrt.engine.pipelines.wan.rows import VideoRows

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel


class WanBlocks(TransformerBlocks):
    """See the module. ``experts`` is each expert with the call's rows it
    runs (None: every row), in order; ``video`` the rows' input (each
    size's (g, C, F, h, w), the i2v condition channels already beside the
    latents) and rotary table (``rows.py``: per row in a padded call);
    ``lora_subset`` narrows the rows' adapters to an expert's sub-batch."""

    def __init__(self, experts: list[tuple[WanTransformer3DModel, torch.Tensor | None]],
                 video: VideoRows, timestep: torch.Tensor, embeds: torch.Tensor,
                 lora_subset: Callable[[torch.Tensor | None], AbstractContextManager]):
        self.model = experts[0][0]
        self.experts = [model for model, _ in experts]
        self.blocks = list(self.model.blocks)
        self.count = len(self.blocks)
        self.video = video  # its rotary: no weights, the experts' tables are the same
        rows = video.rows
        device = timestep.device
        #: each row's expert (its position in ``experts``)
        self.expert_of = torch.zeros(rows, dtype=torch.long, device=device)
        index_of: list[torch.Tensor | None] = []
        parts: list[list[torch.Tensor]] = [[], [], [], []]  # hidden, encoder, temb, proj
        for k, (model, index) in enumerate(experts):
            if index is not None:
                self.expert_of[index] = k
            ts, es = (timestep, embeds) if index is None else (timestep[index], embeds[index])
            hidden = video.embed(model, index)
            temb, proj, encoder, _ = model.condition_embedder(ts, es, None, timestep_seq_len=None)
            index_of.append(index)
            for part, value in zip(parts, (hidden, encoder, temb, proj.unflatten(1, (6, -1))),
                                   strict=True):
                part.append(value)
        self.hidden, self.encoder, self.temb, self.proj = (
            _merge(index_of, part, rows) for part in parts)
        #: the rows' adapters narrowed to an expert's rows (the pipeline's)
        self.lora_subset = lora_subset
        self.row_inputs = {}
        self.shared_inputs = {}

    def _groups(self, rows: torch.Tensor | None, total: int
                ) -> list[tuple[int, torch.Tensor | None]]:
        """The experts over a sub-batch of ``total`` rows (``rows`` of the
        call, None: all): (expert, positions in the sub-batch; None: all)."""
        mine = self.expert_of if rows is None else self.expert_of.index_select(0, rows)
        present = mine.unique().tolist()
        if len(present) == 1:
            return [(int(present[0]), None)]
        return [(int(k), (mine == k).nonzero().squeeze(1)) for k in present]

    def run(self, start: int, stop: int, hidden: torch.Tensor, encoder: torch.Tensor | None,
            rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks ``start:stop`` of each row's expert over ``rows``' streams
        (Wan's blocks take the text and return the image stream only)."""
        assert encoder is not None
        proj = self.proj if rows is None else self.proj.index_select(0, rows)
        rotary = self.video.rotary_of(rows)
        groups = self._groups(rows, hidden.shape[0])
        out = hidden if len(groups) == 1 else torch.empty_like(hidden)
        for k, at in groups:
            h, e, p, r = (hidden, encoder, proj, rotary) if at is None else (
                hidden.index_select(0, at), encoder.index_select(0, at), proj.index_select(0, at),
                rotary if len(rotary) == 2 else tuple(part.index_select(0, at) for part in rotary))
            with self.lora_subset(at):
                for block in list(self.experts[k].blocks)[start:stop]:
                    h = block(h, e, p, r)
            if at is None:
                return h, encoder
            out.index_copy_(0, at, h)
        return out, encoder

    def modulated_input(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """TeaCache's Wan signal (see the module): the rows' time embedding,
        (rows, 1, dim)."""
        temb = self.temb if rows is None else self.temb.index_select(0, rows)
        return temb.unsqueeze(1)

    def out(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's expert's ``norm_out`` (modulated by its ``temb``) and
        ``proj_out``: patch tokens."""
        groups = self._groups(None, hidden.shape[0])
        out: torch.Tensor | None = None
        for k, at in groups:
            model = self.experts[k]
            h, temb = (hidden, self.temb) if at is None else (
                hidden.index_select(0, at), self.temb.index_select(0, at))
            shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
            h = (model.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
            pred = model.proj_out(h)
            if at is None:
                return pred
            if out is None:
                out = pred.new_empty(hidden.shape[0], *pred.shape[1:])
            out.index_copy_(0, at, pred)
        assert out is not None  # a call has rows
        return out


def _merge(index: list[torch.Tensor | None], parts: list[torch.Tensor],
           rows: int) -> torch.Tensor:
    """Per-expert tensors, each of its ``index`` rows, as one in row order
    (one expert over every row: its own)."""
    if len(parts) == 1:
        return parts[0]
    out = parts[0].new_empty(rows, *parts[0].shape[1:])
    for at, value in zip(index, parts, strict=True):
        assert at is not None  # several experts: each has its rows
        out.index_copy_(0, at, value)
    return out


__all__ = ["WanBlocks"]
