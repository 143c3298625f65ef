"""The transformer call over rows, and the features that wrap it as layers.

A ``RowsCall`` is one call's inputs — latents (rows, tokens, dim), each
row's timestep and guidance, the text embeddings and the family's second
text output, and the ``RowLayout`` that says each row's size, LoRA
adapters and step cache. A ``TransformerCall`` maps it to the prediction.
The innermost one is the family's (``FamilyCall``: its
``transformer_forward`` over rows of one size); each feature that changes
how rows reach it is a layer wrapping the one below, in the one order
``CALL_LAYERS`` states (outermost first)::

    BlockOffload   offload="layerwise": the blocks' weights streamed in ahead of use
    RowsBySize     mixed_rows="by_size": a call per latent size (edit sizes too)
    LoraRows       the rows' LoRA adapters active on the hooked linears
    StepCache      rows with a step cache: their call cut at the blocks
    RowsPacked     mixed_rows="packed": every row's tokens in one sequence
    RowsPadded     rows of several sizes zero-padded, masked (the default)
    SequenceShard  a call's image tokens split over the sequence group
    FamilyCall     the family's transformer_forward (compiled or eager model)

Each layer passes a call it has nothing to do for straight down; a layer
that takes a call itself (``StepCache``, ``RowsPacked``, ``RowsPadded``)
runs the family's other entry for it (its blocks, its packed or padded
forward), so what sits below it sees only what it passes. The order is
what the features need:

- the offload outermost: its per-block pre-hooks (the mechanism that must
  stay per block: a copy is waited for as its block starts) serve every
  call below, whichever layer takes it; the layer installs and removes them;
- a call per size before the adapters and caches, so each size's call
  describes its own rows' adapters and decides its own caches;
- the adapters around the cache, whose sub-batches narrow them to the rows
  that compute (``cached_call``'s ``rows_context``);
- packed before padded: a packed call falls back to padded where it cannot
  pack (adapters index rows, an edit's tokens are not its image's);
- the sequence split innermost, over calls of one size (a padded call runs
  whole on every rank): it begins the split, the family's hooks that it
  installed shard the tokens where that model can cut them, and it ends the
  split with the output gathered.

Nothing swaps ``transformer`` out and back: a layer wraps calls, and the
model hooks a feature needs are installed once, by the layer's ``install``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist

from diffrt.engine.cache.forward import cached_call
from diffrt.engine.parallel.attention import JointAttention
from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.contract import FlowMatchHost, OffloadHost, SequenceHost
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.weights.offload import LayerwiseOffload
from diffrt.platforms.interface import Platform


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

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, RowLayout]:
        """The family's entries' arguments, in their order."""
        return (self.latents, self.timesteps, self.embeds, self.extra, self.guidance,
                self.layout)


class TransformerCall(Protocol):
    """A call over rows -> the prediction, (rows, tokens, dim) like the latents."""

    def __call__(self, call: RowsCall) -> torch.Tensor: ...


class FamilyCall:
    """The family's own call over rows of one size (``transformer_forward``,
    looked up on the pipeline at each call, so a wrapper set on it is
    honoured)."""

    def __init__(self, host: FlowMatchHost):
        self.host = host

    def __call__(self, call: RowsCall) -> torch.Tensor:
        return self.host.transformer_forward(*call.inputs())


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

        with self.host.transformer_blocks(*call.inputs()) as blocks:
            return cached_call(blocks, layout.caches, layout.tokens, rows_context)


class RowsPacked(CallLayer):
    """``mixed_rows="packed"``: rows of several sizes as one sequence of
    their tokens, nothing padded (the family's ``packed_forward``, where it
    has one: ``packs_rows``); rows with adapters or an edit's tokens go on
    to the padded call."""

    def __call__(self, call: RowsCall) -> torch.Tensor:
        layout = call.layout
        if (layout.uniform or self.host.mixed_rows != "packed" or not self.host.packs_rows
                or layout.loras or layout.conds):
            return self.inner(call)
        return self.host.packed_forward(*call.inputs())


class RowsPadded(CallLayer):
    """Rows of several sizes zero-padded to the longest, their padding keys
    masked (the family's ``padded_forward``: a rotary table per row)."""

    def __call__(self, call: RowsCall) -> torch.Tensor:
        if call.layout.uniform:
            return self.inner(call)
        return self.host.padded_forward(*call.inputs())


class SequenceShard(CallLayer):
    """The sequence split (``engine.parallel.sequence``): a call begins it
    over its image tokens, the family's hooks (``install``) shard the tokens
    and attend over the group, and the call ends it, the output gathered
    along the tokens (a family whose model gathers earlier, before it
    un-patchifies, has ended it already)."""

    @staticmethod
    def install(host: SequenceHost, group: dist.ProcessGroup | None, attend: JointAttention) -> SequenceSplit:
        """Split each call over ``group``: the family's model hooks
        (``sequence_hooks``) installed once, the split left on the host."""
        split = SequenceSplit(group, attend)
        host.sequence_hooks(split)
        host.sequence_split = split
        return split

    def __call__(self, call: RowsCall) -> torch.Tensor:
        split = self.host.sequence_split
        if split is None:
            return self.inner(call)
        split.begin(call.latents.shape[1])
        split.text_len = call.embeds.shape[1]
        try:
            out = self.inner(call)
        except BaseException:
            split.active = False
            raise
        return split.end(out, 1)


class BlockOffload(CallLayer):
    """Layer-wise offload (``engine.weights.offload``): the blocks' weights
    live in host memory and stream to the device ahead of use. What must
    act per block stays per block — the pre-hooks that wait for a block's
    copy and issue the next ones — and this layer owns them: ``install``
    puts them on the model, ``remove`` takes them off. A call passes through
    it: its place, outermost, says that every call below, whichever layer
    takes it, runs its blocks through those hooks."""

    @staticmethod
    def install(host: OffloadHost, platform: Platform, prefetch: int,
                device: torch.device) -> LayerwiseOffload:
        offload = LayerwiseOffload(host.offload_blocks(), platform, device, prefetch=prefetch)
        host.offload = offload
        return offload

    @staticmethod
    def remove(host: OffloadHost) -> None:
        """The hooks off the blocks; their weights stay where they are."""
        if host.offload is not None:
            host.offload.remove_hooks()
            host.offload = None

    def __call__(self, call: RowsCall) -> torch.Tensor:
        return self.inner(call)


#: the layers around the family's call, outermost first (see the module)
CALL_LAYERS: tuple[type[CallLayer], ...] = (BlockOffload, RowsBySize, LoraRows, StepCache,
                                            RowsPacked, RowsPadded, SequenceShard)


def build_call(host: FlowMatchHost,
               layers: tuple[type[CallLayer], ...] = CALL_LAYERS) -> TransformerCall:
    """The family's call wrapped in ``layers``, the first outermost."""
    call: TransformerCall = FamilyCall(host)
    for layer in reversed(layers):
        call = layer(call, host)
    return call


__all__ = ["CALL_LAYERS", "BlockOffload", "CallLayer", "FamilyCall", "LoraRows", "RowsBySize",
           "RowsCall", "RowsPacked", "RowsPadded", "SequenceShard", "StepCache",
           "TransformerCall", "build_call"]
