"""The transformer call over rows, and the features that wrap it as layers.

A ``RowsCall`` is one call's inputs — latents (rows, tokens, dim), each
row's timestep and guidance, the text embeddings and the family's second
text output, and the ``RowLayout`` that says each row's size, LoRA
adapters and step cache. A ``TransformerCall`` maps it to the prediction.
The innermost one is the family's (``FamilyCall``: its
``transformer_forward``); each feature that changes how rows reach it is a
layer wrapping the one below, in the one order ``CALL_LAYERS`` states
(outermost first)::

    RowsBySize  mixed_rows="by_size": a call per latent size (edit sizes too)
    LoraRows    the rows' LoRA adapters active on the hooked linears
    StepCache   rows with a step cache: their call cut at the blocks
    FamilyCall  the family's transformer_forward (compiled or eager model)

Each layer passes a call it has nothing to do for straight down. The order
is what the features need: a call per size first, so each size's call
describes its own rows' adapters and decides its own caches; the adapters
around the cache, whose sub-batches narrow them to the rows that compute
(``cached_call``'s ``rows_context``). Below the family's call sit the
features its model carries as hooks: the sequence split (the family's
attention processors and token wrappers, ``engine.parallel.sequence``) and
layer-wise offload (each block's pre-hooks, ``engine.weights.offload``).
The padded and packed ways of mixing sizes are the family call's own (its
per-row rotary tables and key masks; Flux's packed forward).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from diffrt.engine.cache.forward import cached_call
from diffrt.engine.pipelines.contract import FlowMatchHost
from diffrt.engine.pipelines.segments import RowLayout


@dataclass(frozen=True)
class RowsCall:
    """One transformer call's inputs (see the module); ``timesteps`` and
    ``guidance`` per row."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    embeds: torch.Tensor
    extra: torch.Tensor
    guidance: torch.Tensor
    layout: RowLayout

    def rows(self, members: list[int]) -> RowsCall:
        """The call of rows ``members`` alone, as long as their longest row."""
        index = torch.tensor(members, device=self.latents.device)
        sub = RowLayout.join([self.layout.rows(slice(i, i + 1)) for i in members])
        def take(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, index)

        return replace(self, latents=take(self.latents)[:, :sub.longest],
                       timesteps=take(self.timesteps), embeds=take(self.embeds),
                       extra=take(self.extra), guidance=take(self.guidance), layout=sub)


class TransformerCall(Protocol):
    """A call over rows -> the prediction, (rows, tokens, dim) like the latents."""

    def __call__(self, call: RowsCall) -> torch.Tensor: ...


class FamilyCall:
    """The family's own call (``transformer_forward``, looked up on the
    pipeline at each call, so a wrapper set on it is honoured)."""

    def __init__(self, host: FlowMatchHost):
        self.host = host

    def __call__(self, call: RowsCall) -> torch.Tensor:
        return self.host.transformer_forward(call.latents, call.timesteps, call.embeds,
                                             call.extra, call.guidance, call.layout)


class CallLayer(ABC):
    """A feature around the call below it (``inner``)."""

    def __init__(self, inner: TransformerCall, host: FlowMatchHost):
        self.inner = inner
        self.host = host

    @abstractmethod
    def __call__(self, call: RowsCall) -> torch.Tensor: ...


class RowsBySize(CallLayer):
    """``mixed_rows="by_size"``: a call of rows of several sizes runs as one
    call per (size, edit sizes), each as long as its own rows; the
    predictions, in row order, zero-padded to the call's tokens as a padded
    call's would be (the loop cuts each back to its own)."""

    def __call__(self, call: RowsCall) -> torch.Tensor:
        layout = call.layout
        if layout.uniform or self.host.mixed_rows != "by_size":
            return self.inner(call)
        groups: dict[tuple, list[int]] = {}
        for row, size in enumerate(layout.sizes):
            groups.setdefault((size, layout.cond_of(row)), []).append(row)
        out: torch.Tensor | None = None
        for members in groups.values():
            pred = self.inner(call.rows(members))
            if out is None:
                out = pred.new_zeros(len(layout), call.latents.shape[1], pred.shape[-1])
            out[torch.tensor(members, device=pred.device), :pred.shape[1]] = pred
        assert out is not None  # a call has rows
        return out


class LoraRows(CallLayer):
    """The rows' LoRA adapters (``layout.loras``) applied by the hooked
    linears while the call below runs (``engine.lora.row_lora``)."""

    def __call__(self, call: RowsCall) -> torch.Tensor:
        loras = self.host.row_loras
        if not call.layout.loras or loras is None:
            return self.inner(call)
        with loras.rows(call.layout.loras):
            return self.inner(call)


class StepCache(CallLayer):
    """Rows with a step cache (``layout.caches``): the family's call cut at
    its blocks, each request deciding for its rows, the rows that compute
    running the blocks as one sub-batch (``engine.cache.forward``)."""

    def __call__(self, call: RowsCall) -> torch.Tensor:
        layout = call.layout
        if not layout.caches:
            return self.inner(call)
        rows_context: Callable[[list[int]], contextlib.AbstractContextManager] | None = None
        loras = self.host.row_loras
        if layout.loras and loras is not None:
            uses = layout.loras

            def rows_context(rows: list[int]) -> contextlib.AbstractContextManager:
                return loras.rows(tuple(uses[r] for r in rows))

        with self.host.transformer_blocks(call.latents, call.timesteps, call.embeds,
                                          call.extra, call.guidance, layout) as blocks:
            return cached_call(blocks, layout.caches, layout.tokens, rows_context)


#: the layers around the family's call, outermost first (see the module)
CALL_LAYERS: tuple[type[CallLayer], ...] = (RowsBySize, LoraRows, StepCache)


def build_call(host: FlowMatchHost,
               layers: tuple[type[CallLayer], ...] = CALL_LAYERS) -> TransformerCall:
    """The family's call wrapped in ``layers``, the first outermost."""
    call: TransformerCall = FamilyCall(host)
    for layer in reversed(layers):
        call = layer(call, host)
    return call


__all__ = ["CALL_LAYERS", "CallLayer", "FamilyCall", "LoraRows", "RowsBySize", "RowsCall",
           "StepCache", "TransformerCall", "build_call"]
