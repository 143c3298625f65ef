"""One transformer call whose rows decide, request by request, what to skip.

A family gives its call cut at its blocks (``TransformerBlocks``: the
embedded streams, a run over a range of blocks for a subset of the rows,
the first block's modulated input, the output head). ``cached_call`` then:

1. TeaCache requests decide from their modulated input (cheap: one norm);
2. the first block runs for every row still to compute — rows without a
   cache, TeaCache requests that compute, every First-Block Cache request —
   and First-Block Cache requests decide from its residual;
3. the remaining blocks run once, as a sub-batch of the rows that compute;
4. reusing rows add their request's stored residual instead; every row
   goes through the output head together.

When no row reuses, the blocks run over all rows in order, the same
operations as the family's uncached forward. A request's decision covers
all its rows (its outputs and both CFG branches), which the layout gives
as the same ``RequestCache`` on each.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from diffrt.engine.cache.policies import TEACACHE
from diffrt.engine.cache.state import RequestCache

#: a block input indexed by row: a tensor (rows first), a pair of them (a
#: rotary table per row), a mapping of them (``joint_attention_kwargs``)
RowInput = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


def rows_of(value: RowInput, rows: torch.Tensor) -> RowInput:
    """``value`` for the call's rows ``rows`` (see ``RowInput``)."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows)
    if isinstance(value, tuple):
        return tuple(part.index_select(0, rows) for part in value)
    return {name: part.index_select(0, rows) for name, part in value.items()}


class TransformerBlocks(ABC):
    """A family's transformer call, embedded and cut at its blocks; the
    streams are (rows, tokens, dim), ``rows`` an index of the call's rows
    (None: all of them). The block loop is written once (``run``): a family
    gives its blocks' keyword inputs, those indexed by row (``row_inputs``:
    a sub-batch takes its rows of them) and those shared by every row
    (``shared_inputs``); each block takes the image and text streams and
    returns (text, image), as diffusers' double- and single-stream blocks do."""

    #: the diffusers transformer, and its blocks in call order
    model: Any
    blocks: list[Any]
    #: the image stream and the text stream after the embeddings, and the
    #: timestep (and pooled text) embedding that modulates every block, per row
    hidden: torch.Tensor
    encoder: torch.Tensor | None
    temb: torch.Tensor
    #: the number of blocks
    count: int
    #: every block call's other keyword inputs (see the class)
    row_inputs: dict[str, RowInput]
    shared_inputs: dict[str, object]

    def run(self, start: int, stop: int, hidden: torch.Tensor, encoder: torch.Tensor | None,
            rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks ``start:stop`` over ``rows``' streams."""
        kwargs = dict(self.shared_inputs)
        for name, value in self.row_inputs.items():
            kwargs[name] = value if rows is None else rows_of(value, rows)
        for block in self.blocks[start:stop]:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder,
                                    **kwargs)
        return hidden, encoder

    @staticmethod
    def attention_inputs(mask: torch.Tensor | None) -> dict[str, RowInput]:
        """A padded call's key mask as the blocks take it (none: no entry)."""
        return {} if mask is None else {"joint_attention_kwargs": {"attention_mask": mask}}

    def modulated_input(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The first block's timestep-modulated image input (TeaCache's
        signal): its ``norm1`` (diffusers' ``AdaLayerNormZero`` and kin
        return the modulated input first)."""
        temb = self.temb if rows is None else self.temb.index_select(0, rows)
        return self.blocks[0].norm1(hidden, emb=temb)[0]

    def run_all(self) -> torch.Tensor:
        """The whole call uncached: every block over every row, then the head
        (a family's forward over rows of several sizes)."""
        hidden, _ = self.run(0, self.count, self.hidden, self.encoder, None)
        return self.out(hidden)

    def out(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over every row's final image stream (diffusers'
        ``norm_out`` then ``proj_out``)."""
        return self.model.proj_out(self.model.norm_out(hidden, self.temb))


def _take(x: torch.Tensor | None, rows: list[int], total: int, device: torch.device
          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``x``'s rows and their index (x itself and None for all rows)."""
    if len(rows) == total:
        return x, None
    index = torch.tensor(rows, device=device)
    return (None if x is None else x.index_select(0, index)), index


class _Rows:
    """Row positions within the call and within a sub-batch of it."""

    def __init__(self, members: list[int], device: torch.device):
        self.members = members
        self.at = {row: k for k, row in enumerate(members)}
        self.device = device

    def of(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor([self.at[r] for r in rows], device=self.device)


def cached_call(blocks: TransformerBlocks, caches: tuple[RequestCache | None, ...],
                tokens: tuple[int, ...],
                rows_context: Callable[[list[int]], AbstractContextManager] | None = None
                ) -> torch.Tensor:
    """The call's prediction with each request's cache deciding for its rows
    (see the module). ``tokens`` is each row's own image tokens (a padded
    call's rows are as long as the longest: a request compares and keeps its
    own tokens only, so its state does not depend on its batch mates);
    ``rows_context(rows)`` is held while blocks run over only ``rows`` of the
    call (per-row state such as LoRA adapters)."""
    hidden, encoder = blocks.hidden, blocks.encoder
    total, device = hidden.shape[0], hidden.device
    context = rows_context or (lambda rows: contextlib.nullcontext())
    everyone = _Rows(list(range(total)), device)
    owners: dict[int, tuple[RequestCache, list[int]]] = {}
    for row, cache in enumerate(caches):
        if cache is not None:
            owners.setdefault(id(cache), (cache, []))[1].append(row)
    head: list[int] = [row for row, cache in enumerate(caches) if cache is None]
    tea_reuse, tea_compute, first_block = [], [], []
    for cache, rows in owners.values():
        n = tokens[rows[0]]
        if cache.plan.policy != TEACACHE:
            first_block.append((cache, rows))
            head += rows
            continue
        mine, index = _take(hidden, rows, total, device)
        with context(rows):  # the first block's modulation may carry adapters
            modulated = blocks.modulated_input(mine, index)  # type: ignore[arg-type]
        if cache.decide_teacache(modulated[:, :n]):
            tea_reuse.append((cache, rows))
        else:
            tea_compute.append((cache, rows))
            head += rows
    head.sort()
    final: torch.Tensor | None = None
    h1: torch.Tensor | None = None
    fb_reuse = []
    if head:
        in_head = _Rows(head, device)
        h_in, head_index = _take(hidden, head, total, device)
        e_in, _ = _take(encoder, head, total, device)
        with context(head):
            h1, e1 = blocks.run(0, 1, h_in, e_in, head_index)  # type: ignore[arg-type]
        tail = [row for row in head if caches[row] is None]
        for cache, rows in first_block:
            n, pos = tokens[rows[0]], in_head.of(rows)
            residual = h1.index_select(0, pos)[:, :n] - h_in.index_select(0, pos)[:, :n]  # type: ignore[union-attr]
            if cache.decide_first_block(residual):
                fb_reuse.append((cache, rows))
            else:
                tail += rows
        tail += [row for _, rows in tea_compute for row in rows]
        tail.sort()
        if tail:
            in_tail = _Rows(tail, device)
            h_t, _ = _take(h1, [in_head.at[r] for r in tail], len(head), device)
            e_t, _ = _take(e1, [in_head.at[r] for r in tail], len(head), device)
            _, tail_index = _take(None, tail, total, device)
            with context(tail):
                h_out, _ = blocks.run(1, blocks.count, h_t, e_t, tail_index)  # type: ignore[arg-type]
            if len(tail) == total:
                final = h_out
            else:
                final = torch.empty_like(hidden)
                final.index_copy_(0, everyone.of(tail), h_out)
            for cache, rows in first_block:
                if cache.pending is not None and not cache.pending.reused:
                    n = tokens[rows[0]]
                    cache.computed_residual(h_out.index_select(0, in_tail.of(rows))[:, :n]
                                            - h1.index_select(0, in_head.of(rows))[:, :n])
            for cache, rows in tea_compute:
                n = tokens[rows[0]]
                cache.computed_residual(h_out.index_select(0, in_tail.of(rows))[:, :n]
                                        - hidden.index_select(0, everyone.of(rows))[:, :n])
    if final is None:
        final = torch.empty_like(hidden)
    for cache, rows in fb_reuse:
        assert h1 is not None
        _reuse(final, h1.index_select(0, in_head.of(rows)), cache, rows, tokens, everyone)
    for cache, rows in tea_reuse:
        _reuse(final, hidden.index_select(0, everyone.of(rows)), cache, rows, tokens, everyone)
    return blocks.out(final)


def _reuse(final: torch.Tensor, start: torch.Tensor, cache: RequestCache, rows: list[int],
           tokens: tuple[int, ...], everyone: _Rows) -> None:
    """A reusing request's rows: where its skipped blocks began, plus their
    stored residual over its own tokens (its padding, never read, as it began)."""
    assert cache.residual is not None
    n = tokens[rows[0]]
    value = start.clone()
    value[:, :n] += cache.residual
    final.index_copy_(0, everyone.of(rows), value)
