"""Model offload: whole components live in page-locked host memory and are
copied to the device when one of their layers is about to run.

``offload="model"`` manages every component (transformer, VAE, text
encoders); ``offload_text_encoders`` manages the text encoders only and
keeps the others on the device. Using any component — managed or kept —
first sends the other managed components back to the host, so at most one
managed component is on the device at a time, beside the kept ones. A
component stays on the device until another one is needed: the transformer
runs every denoise step of a request without moving, and moves off for the
VAE's decode (or a text encoding the prompt cache misses) and back for the
next step — the way diffusers' ``enable_model_cpu_offload`` chains its
models, but through ``Platform`` (pinned memory, ``copy_async``, events), so
it runs on every vendor and on the simulated device of the tests, where a
copy lands late and a missing wait shows as wrong pixels.

Each component's plain tensors (parameters and buffers) are packed once into
one host buffer (``Platform.empty_pinned``: page-locked where the platform
can, so the copy is a DMA). Bringing a component on allocates a device
tensor per parameter, queues its copy on the current stream and makes the
compute wait for an event recorded after the copies
(``Platform.wait_for_compute``; a platform without events copies
synchronously). Sending it back points every parameter at its host copy
again; nothing is copied back, since inference never writes weights, and
the device tensors go with their last reference (a layer that re-creates its
parameters per call — diffusers' layerwise casting under ``fp8-storage`` —
leaves no second copy behind). A tensor subclass (torchao's int8 and fp8
weights) cannot be packed into bytes: its host copy is the subclass itself
on the CPU and it moves with ``.to``.

Hooks: a forward pre-hook on the component and on every module of it that
holds tensors of its own, so a component entered through a method other
than ``forward`` (``vae.decode`` calls its ``post_quant_conv`` and
``decoder``) is brought on before its first layer computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from diffrt.engine.weights.packing import empty_like_aligned, nbytes, pack_into, start_at
from diffrt.engine.weights.resident import storage_bytes
from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


class _Slot:
    """One parameter or buffer of a component: where it lives in its module
    and its host copy."""

    __slots__ = ("host", "module", "name", "parameter")

    def __init__(self, module: torch.nn.Module, name: str, parameter: bool):
        self.module, self.name, self.parameter = module, name, parameter
        self.host: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    def source(self) -> torch.Tensor:
        """What this slot points at on the host."""
        assert self.host is not None
        return self.host

    def set(self, value: torch.Tensor) -> None:
        current = self.get()
        if self.parameter and _plain(value) and _plain(current):
            current.data = value  # keeps the Parameter object others may hold
        elif self.parameter:
            setattr(self.module, self.name, torch.nn.Parameter(value, requires_grad=False))
        else:
            self.module._buffers[self.name] = value


class _Tied(_Slot):
    """A second owner of a tensor another slot already holds (tied weights)."""

    __slots__ = ("first",)

    def __init__(self, module: torch.nn.Module, name: str, parameter: bool, first: _Slot):
        super().__init__(module, name, parameter)
        self.first = first

    def source(self) -> torch.Tensor:
        return self.first.get()


class _Component:
    """One component's host copies and whether it is on the device."""

    def __init__(self, name: str, module: torch.nn.Module, platform: Platform):
        self.name, self.module = name, module
        self.slots: list[_Slot] = []
        packed: list[tuple[_Slot, torch.Tensor, int]] = []
        offset = 0
        seen: dict[int, _Slot] = {}
        for owner in module.modules():
            for attr, parameter in ((owner._parameters, True), (owner._buffers, False)):
                for key, tensor in attr.items():
                    if tensor is None or tensor.device.type == "meta":
                        continue
                    if id(tensor) in seen:  # tied weights: one copy, every owner re-pointed
                        self.slots.append(_Tied(owner, key, parameter, seen[id(tensor)]))
                        continue
                    slot = _Slot(owner, key, parameter)
                    seen[id(tensor)] = slot
                    self.slots.append(slot)
                    data = tensor.data if parameter else tensor
                    if _plain(data):
                        start = start_at(offset, data)
                        packed.append((slot, data, start))
                        offset = start + nbytes(data)
                    else:
                        slot.host = data.to("cpu")
        self.nbytes = offset
        self.host = platform.empty_pinned((max(offset, 1),), torch.uint8)
        for slot, data, start in packed:
            slot.host = pack_into(self.host, start, data)
        #: bytes the subclass tensors' host copies hold (beside the packed buffer)
        self.other_bytes = sum(storage_bytes(s.host) for s in self.slots
                               if not isinstance(s, _Tied) and s.host is not None
                               and not _plain(s.host))
        self.on_device = False
        self.to_host()

    def to_host(self) -> None:
        for slot in self.slots:
            slot.set(slot.source())
        self.on_device = False

    def to_device(self, platform: Platform, device: torch.device, events: bool) -> None:
        for slot in self.slots:
            if isinstance(slot, _Tied):
                continue
            host = slot.host
            assert host is not None
            if _plain(host):
                target = empty_like_aligned(host, device)
                if events:
                    platform.copy_async(target, host)
                else:
                    target.copy_(host)
            else:
                target = host.to(device)
            slot.set(target)
        for slot in self.slots:
            if isinstance(slot, _Tied):
                slot.set(slot.source())
        if events:
            copied = platform.record_device_event()
            if copied is not None:
                platform.wait_for_compute(copied)
        self.on_device = True

    @property
    def host_bytes(self) -> int:
        return self.nbytes + self.other_bytes


class ModelOffload:
    """Moves whole ``components`` (name -> module) between page-locked host
    memory and ``device`` as they are used; those named in ``kept`` stay on
    the device and only send the managed ones back when they run. See the
    module docstring."""

    def __init__(self, components: dict[str, torch.nn.Module], platform: Platform,
                 device: torch.device, *, kept: Iterable[str] = ()):
        kept = set(kept)
        self.platform, self.device = platform, device
        self.managed = {name: _Component(name, module, platform)
                        for name, module in components.items() if name not in kept}
        if not self.managed:
            raise ValueError("model offload needs a component to offload")
        self._events = self._has_events()
        #: the managed component on the device now (None: all on the host)
        self.current: _Component | None = None
        #: how often a component was brought on (name -> count)
        self.loads: dict[str, int] = dict.fromkeys(self.managed, 0)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for name, module in components.items():
            part = self.managed.get(name)
            for owner in module.modules():
                if owner is module or owner._parameters or owner._buffers:
                    self._hooks.append(owner.register_forward_pre_hook(self._before(part)))
        logger.info("model offload: %s in host memory (%.1f MiB); kept on the device: %s",
                    ", ".join(self.managed), self.host_bytes / 2**20,
                    ", ".join(sorted(kept & set(components))) or "none")

    def _has_events(self) -> bool:
        try:
            return self.platform.record_device_event() is not None
        except Exception:  # a backend without events: synchronous copies
            return False

    @property
    def host_bytes(self) -> int:
        return sum(part.host_bytes for part in self.managed.values())

    @property
    def largest_bytes(self) -> int:
        """What the managed components take on the device at most: the largest."""
        return max(part.host_bytes for part in self.managed.values())

    def use(self, part: _Component | None) -> None:
        """``part`` on the device (None: a kept component), every other
        managed component on the host."""
        if self.current is part:
            return
        if self.current is not None:
            self.current.to_host()
            self.current = None
        if part is not None:
            try:
                part.to_device(self.platform, self.device, self._events)
            except BaseException:  # out of memory half-way: nothing left on the device
                part.to_host()
                raise
            self.loads[part.name] += 1
            self.current = part

    def _before(self, part: _Component | None) -> Callable[[torch.nn.Module, tuple[object, ...]],
                                                           None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...]) -> None:
            if self.current is not part:
                self.use(part)
        return hook


__all__ = ["ModelOffload"]
