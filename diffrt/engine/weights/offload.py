"""Layer-wise offload: a transformer's blocks live in page-locked host memory
and stream to the device ahead of use, on the platform's own primitives.

Each block's parameters are packed into one host buffer (``Platform.
empty_pinned``: page-locked where the platform can, so the copy is a real
DMA); the device holds ``prefetch + 1`` slots, each a flat buffer the size
of the largest block, and a block runs with its parameters pointing into the
slot its copy landed in. Before block ``i`` runs, the compute waits for its
copy's event (``Platform.wait_for_compute``) and the copies of the next
``prefetch`` blocks (in execution order, wrapping to the first block for the
next call) are issued on a side stream; a copy into a slot first waits for
the event recorded when the block after the slot's previous one started
(every kernel of that block is queued by then), so a block's weights are
never overwritten under it. The hooks sit on each block and on each of its
weighted layers, so a path that calls a block's layers without the block
(Flux's packed rows, TeaCache's look at the first block) waits too; a block
whose slot is taken points back at its host copy. Two events per block
order copy and compute, the way diffusers' group offloading does with CUDA streams — but
through ``Platform`` (streams, events, pinned memory, ``copy_async``), so it
runs on every vendor with events, and on the simulated device of the tests,
where a copy lands late and a missing wait shows as wrong pixels. A platform
without usable events (``record_device_event`` None) copies synchronously
before each block.

A block a step cache skips does not run: its slot is taken by the next copy
that needs one, and the block is copied again when it next runs. What the
device holds is the non-block parameters plus the slots:
``(prefetch + 1) x`` the largest block (``device_bytes``). On the simulated
device compute runs on the host thread, so only the compute-side wait can
show as wrong pixels there; the copy-side wait is checked by the order of
the recorded calls (tests/engine/test_offload.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from diffrt.engine.weights.packing import nbytes, pack_into, start_at, view_at
from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a diffusers transformer, in the order its
    forward runs them: every ``nn.ModuleList`` child of two or more modules,
    in registration order (Flux: ``transformer_blocks`` then
    ``single_transformer_blocks``; SD3 and Qwen-Image: ``transformer_blocks``)."""
    blocks: list[torch.nn.Module] = []
    for child in transformer.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2:
            blocks.extend(child)
    return blocks


class _Block:
    """One block's packed host copy and where each parameter sits in it."""

    def __init__(self, index: int, module: torch.nn.Module, platform: Platform):
        self.index = index
        self.module = module
        self.params: list[tuple[torch.nn.Parameter, int, torch.dtype, torch.Size]] = []
        offset = 0
        for param in module.parameters():
            start = start_at(offset, param)
            self.params.append((param, start, param.dtype, param.shape))
            offset = start + nbytes(param)
        self.nbytes = offset
        self.host = platform.empty_pinned((max(offset, 1),), torch.uint8)
        for param, start, _dtype, _shape in self.params:
            pack_into(self.host, start, param)
        #: the slot holding (or receiving) this block's copy, and its event
        self.slot: int | None = None
        self.copied: Any = None

        #: the parameters' views into each buffer they point at (host, slots),
        #: made once: re-pointing a block is then one assignment a parameter
        self._views: dict[int, list[torch.Tensor]] = {}

    def point_into(self, buffer: torch.Tensor) -> None:
        views = self._views.get(buffer.data_ptr())
        if views is None:
            views = self._views[buffer.data_ptr()] = [
                view_at(buffer, start, dtype, shape) for _, start, dtype, shape in self.params]
        for (param, *_), view in zip(self.params, views, strict=True):
            param.data = view


class LayerwiseOffload:
    """Streams ``blocks`` (in execution order) through ``prefetch + 1``
    device slots; see the module docstring."""

    def __init__(self, blocks: Sequence[torch.nn.Module], platform: Platform,
                 device: torch.device, *, prefetch: int = 1):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if len(blocks) < 2:
            raise ValueError("layer-wise offload needs a model with repeated blocks")
        self.platform, self.device = platform, torch.device(device)
        self.prefetch = min(prefetch, len(blocks) - 1)
        self.blocks = [_Block(i, module, platform) for i, module in enumerate(blocks)]
        slot_bytes = max(block.nbytes for block in self.blocks)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(self.prefetch + 1)]
        #: which block each slot holds, and the event after that block last ran
        self._holder: list[_Block | None] = [None] * len(self.slots)
        self._freed: list[Any] = [None] * len(self.slots)
        self._stream = platform.new_side_stream() if self._has_events() else None
        #: the block whose layers ran last (its slot is free once the next starts)
        self._running: _Block | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for block in self.blocks:
            block.point_into(block.host)  # until first issued
            # on the block and on every layer of it that holds weights: a path
            # that calls a block's layers without the block (Flux's packed rows,
            # TeaCache's look at the first block's norm) still waits for them
            hook = self._before(block)
            for owner in block.module.modules():
                if owner is block.module or owner._parameters:
                    self._hooks.append(owner.register_forward_pre_hook(hook))
        logger.info("layer-wise offload: %d blocks in host memory (%.1f MiB), %d device slots "
                    "of %.1f MiB", len(self.blocks), self.host_bytes / 2**20, len(self.slots),
                    slot_bytes / 2**20)

    def remove_hooks(self) -> None:
        """Take the pre-hooks off the blocks (the call layer that installed
        them, ``pipelines.transformer_call.BlockOffload``, removes them)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _has_events(self) -> bool:
        try:
            return self.platform.record_device_event() is not None
        except Exception:  # a backend without streams: synchronous copies
            return False

    def place_rest(self, module: torch.nn.Module, device: torch.device) -> None:
        """Move ``module``'s parameters outside the blocks, and every buffer,
        to ``device`` (a model loaded into host memory first); the blocks'
        parameters stay in their host buffers."""
        inside = {id(t) for block in self.blocks for t in block.module.parameters()}
        for owner in module.modules():
            for param in owner._parameters.values():
                if param is not None and id(param) not in inside:
                    param.data = param.data.to(device)
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = buffer.to(device)

    @property
    def host_bytes(self) -> int:
        return sum(block.host.numel() for block in self.blocks)

    @property
    def device_bytes(self) -> int:
        """What the slots take on the device."""
        return sum(slot.numel() for slot in self.slots)

    # -- issuing copies ---------------------------------------------------------------
    def _upcoming(self, block: _Block) -> list[_Block]:
        n = len(self.blocks)
        return [self.blocks[(block.index + k) % n] for k in range(1, self.prefetch + 1)]

    def _issue(self, block: _Block, keep: list[_Block]) -> None:
        """Copy ``block`` into a slot held by none of ``keep`` (the blocks
        about to run). A slot whose block may still have kernels queued can
        be taken: the copy waits for the event recorded when the block after
        it started."""
        slot = next((s for s, holder in enumerate(self._holder) if holder is None), None)
        if slot is None:
            slot = next(s for s, holder in enumerate(self._holder) if holder not in keep)
        previous = self._holder[slot]
        if previous is not None:  # back to its host copy: no stale slot under it
            previous.slot, previous.copied = None, None
            previous.point_into(previous.host)
        self._holder[slot], block.slot = block, slot
        target = self.slots[slot]
        if self._stream is None:  # no events: the copy is done when this returns
            target[:block.nbytes].copy_(block.host[:block.nbytes])
            block.copied = None
        else:
            if self._freed[slot] is not None:  # its previous block has run
                self.platform.wait_event(self._stream, self._freed[slot])
            self.platform.copy_async(target[:block.nbytes], block.host[:block.nbytes],
                                     self._stream)
            block.copied = self.platform.record_device_event(self._stream)
        block.point_into(target)

    # -- hooks ------------------------------------------------------------------------
    def _before(self, block: _Block) -> Any:
        """Runs before the block and before each of its weighted layers; only
        the first entry of a block does anything. Entering a block ends the
        one before it: the event recorded then frees that block's slot (every
        kernel of it is queued by now), whichever way its layers were called."""
        def hook(module: torch.nn.Module, args: Any) -> None:
            if block is self._running and block.slot is not None and block.copied is None:
                return
            previous, self._running = self._running, block
            if (self._stream is not None and previous is not None and previous is not block
                    and previous.slot is not None):
                self._freed[previous.slot] = self.platform.record_device_event()
            upcoming = self._upcoming(block)
            if block.slot is None:  # not prefetched (the first call, or skipped for a while)
                self._issue(block, upcoming)
            if block.copied is not None:
                self.platform.wait_for_compute(block.copied)
                block.copied = None
            for nxt in upcoming:
                if nxt.slot is None:
                    self._issue(nxt, [block, *upcoming])
        return hook


__all__ = ["LayerwiseOffload", "transformer_blocks"]
