"""The engine's adapters: names, the requests that hold them, their slots.

An adapter is registered under a name (``DiffusionEngine.add_lora``, or
``lora_modules`` at start) and gets an id of its own: a request names
adapters (``SamplingParams.loras``), and when the engine queues it the names
are resolved to ids and pinned (``pin``, under this registry's lock, so a
``remove_lora`` racing the submission either refuses the request or waits
for it). A removed name refuses new requests at once, while the requests
that already hold it are served: the workers drop the adapter's weights when
the last of them ends (``release`` returns it to drop). Registering the name
again makes a new adapter with a new id, so an old request never runs with
the new file.

The scheduler asks ``admit`` before it lets a request into a batch (device
slots, ``slot_table``) and ``release`` when the request leaves it, in every
ending.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import msgspec

from diffrt.engine.lora.slot_table import SlotTable
from diffrt.engine.record import RequestRecord
from diffrt.engine.sampling import InvalidRequestError


class LoraExistsError(ValueError):
    """``add_lora`` of a name that is registered already (HTTP 409)."""


class LoraInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A registered adapter, as ``list_loras`` and ``GET /v1/loras`` show it."""

    name: str
    path: str
    #: the largest rank of its modules, and how many linear layers it changes
    rank: int
    modules: int
    #: its factors' bytes in host memory (in each worker)
    nbytes: int
    #: requests accepted with it since it was registered
    requests: int
    #: requests holding it now (queued or running)
    active: int
    #: its device slot now (None: on the host only)
    slot: int | None
    #: the version its factors carry (0 as registered; ``update_lora`` names the next)
    version: int | str = 0


@dataclass
class Adapter:
    id: int
    name: str
    path: str
    rank: int = 0
    modules: int = 0
    nbytes: int = 0
    removed: bool = False
    #: requests queued or running with it
    pins: int = 0
    requests: int = 0
    version: int | str = 0


class AdapterRegistry:
    """Registered adapters and their device slots (``max_loras``)."""

    def __init__(self, max_loras: int, *, accepts_adapters: bool, model: str):
        self.max_loras = max_loras
        self.accepts_adapters = accepts_adapters
        self.model = model
        self.slots = SlotTable(max_loras)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, Adapter] = {}
        self._by_id: dict[int, Adapter] = {}
        #: names whose registration is under way (refused as duplicates)
        self._pending: set[str] = set()
        #: removed adapters no request holds any more: to drop in the workers
        self._to_drop: list[int] = []
        #: requests accepted per adapter name since start (kept across a
        #: removal and a new registration: a counter never goes back)
        self._requests_by_name: dict[str, int] = {}

    # -- registration ----------------------------------------------------------------------
    def reserve(self, name: str, path: str) -> Adapter:
        """A new adapter id for ``name`` while its file is read (a duplicate or
        a model without adapters is refused)."""
        if not self.accepts_adapters:
            raise InvalidRequestError("loras", f"{self.model} takes no LoRA adapters")
        if not name or len(name) > 256:
            raise InvalidRequestError("name", f"must be 1-256 characters, got {name!r}")
        with self._lock:
            if name in self._by_name or name in self._pending:
                raise LoraExistsError(f"a LoRA adapter named {name!r} is registered already")
            self._pending.add(name)
            return Adapter(next(self._ids), name, path)

    def confirm(self, adapter: Adapter) -> None:
        with self._lock:
            self._pending.discard(adapter.name)
            self._by_name[adapter.name] = adapter
            self._by_id[adapter.id] = adapter

    def reserve_update(self, name: str, path: str) -> Adapter:
        """A new adapter id for new factors of the registered ``name``
        (``update_lora``; KeyError when it is not registered)."""
        with self._lock:
            current = self._by_name.get(name)
            if current is None:
                raise KeyError(f"no LoRA adapter named {name!r}")
            if name in self._pending:
                raise LoraExistsError(f"LoRA adapter {name!r}: another update is under way")
            self._pending.add(name)
            return Adapter(next(self._ids), name, path, version=current.version)

    def swap(self, adapter: Adapter) -> list[int]:
        """``adapter`` takes its name: requests accepted from now on get it,
        those holding the old one keep it until they end; the ids to drop in
        the workers now (the old one, when nobody holds it)."""
        with self._lock:
            self._pending.discard(adapter.name)
            old = self._by_name.get(adapter.name)
            self._by_name[adapter.name] = adapter
            self._by_id[adapter.id] = adapter
            if old is None:
                return []
            old.removed = True
            return self._drop_if_unused(old)

    def abandon(self, adapter: Adapter) -> None:
        with self._lock:
            self._pending.discard(adapter.name)

    def remove(self, name: str) -> list[int]:
        """Refuse ``name`` from now on (KeyError when it is not registered);
        the ids to drop in the workers now (none while requests hold it)."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise KeyError(f"no LoRA adapter named {name!r}")
            adapter.removed = True
            return self._drop_if_unused(adapter)

    def registered(self) -> list[Adapter]:
        """The adapters a fresh worker must load: registered ones and removed
        ones still held by requests."""
        with self._lock:
            return list(self._by_id.values())

    def infos(self) -> list[LoraInfo]:
        with self._lock:
            return [LoraInfo(name=a.name, path=a.path, rank=a.rank, modules=a.modules,
                             nbytes=a.nbytes, requests=a.requests, active=a.pins,
                             slot=self.slots.slot_of(a.id), version=a.version)
                    for a in sorted(self._by_name.values(), key=lambda a: a.name)]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    # -- requests ----------------------------------------------------------------------------
    def check(self, loras: dict[str, float] | None) -> None:
        """Refuse, naming the field, a request whose adapters this engine cannot serve."""
        if not loras:
            return
        if not self.accepts_adapters:
            raise InvalidRequestError("loras", f"{self.model} takes no LoRA adapters")
        if len(loras) > self.max_loras:
            raise InvalidRequestError("loras", (
                f"{len(loras)} adapters, more than max_loras={self.max_loras} (the adapters "
                "one step may hold on the device)"))
        with self._lock:
            for name, scale in loras.items():
                if not math.isfinite(scale):
                    raise InvalidRequestError("loras", f"{name}: scale must be finite, got {scale}")
                if name not in self._by_name:
                    raise InvalidRequestError("loras", (
                        f"no adapter named {name!r} (registered: "
                        f"{', '.join(sorted(self._by_name)) or 'none'})"))

    def pin(self, record: RequestRecord) -> None:
        """Resolve ``record``'s adapter names to ids and hold them until it ends."""
        loras = record.request.sampling_params.loras
        if not loras:
            return
        with self._lock:
            adapters = []
            for name, scale in loras.items():
                adapter = self._by_name.get(name)
                if adapter is None:
                    raise InvalidRequestError("loras", f"no adapter named {name!r} (removed?)")
                adapters.append((adapter, float(scale)))
            for adapter, _ in adapters:
                adapter.pins += 1
                adapter.requests += 1
                self._requests_by_name[adapter.name] = self._requests_by_name.get(
                    adapter.name, 0) + 1
            record.adapters = tuple((a.id, scale) for a, scale in adapters)
            record.lora_versions = {a.name: a.version for a, _ in adapters}

    # -- the scheduler's (BatchAdapters) -----------------------------------------------------
    def admit(self, record: RequestRecord, *, blocked: bool) -> bool:
        """Device slots for ``record``'s adapters (``record.adapter_slots``); False
        when they do not fit now, or when an earlier request of this pass
        waits for a slot (``blocked``) and this one needs one."""
        if not record.adapters or record.adapter_slots:
            return True
        if blocked:
            return False
        with self._lock:
            slots = self.slots.acquire(adapter_id for adapter_id, _ in record.adapters)
        if slots is None:
            return False
        record.adapter_slots = tuple((slot, scale) for slot, (_, scale)
                                  in zip(slots, record.adapters, strict=True))
        return True

    def could_admit(self, record: RequestRecord) -> bool:
        """``admit`` would give ``record`` its slots now (nothing changes)."""
        if not record.adapters or record.adapter_slots:
            return True
        with self._lock:
            return self.slots.fits(adapter_id for adapter_id, _ in record.adapters)

    def release(self, record: RequestRecord) -> None:
        """``record`` ended (any way): its slots and its hold on the adapters go."""
        if not record.adapters:
            return
        with self._lock:
            if record.adapter_slots:
                self.slots.release(slot for slot, _ in record.adapter_slots)
            for adapter_id, _ in record.adapters:
                adapter = self._by_id.get(adapter_id)
                if adapter is not None:
                    adapter.pins -= 1
                    self._to_drop += self._drop_if_unused(adapter)
            record.adapter_slots = ()
            record.adapters = ()

    def take_installs(self) -> dict[int, int]:
        with self._lock:
            return self.slots.take_installs()

    def slots_empty(self, slots: list[int]) -> None:
        """The workers report ``slots`` empty (an install failed, or a whole
        execute did): the table forgets what it assigned there."""
        if slots:
            with self._lock:
                self.slots.empty(slots)

    def lost(self, adapter_id: int) -> None:
        """Fresh workers could not read ``adapter_id`` again (its file changed
        or went): its name is refused from now on; requests holding it fail
        when they run (their slot stays empty)."""
        with self._lock:
            adapter = self._by_id.get(adapter_id)
            if adapter is not None and self._by_name.get(adapter.name) is adapter:
                del self._by_name[adapter.name]
                adapter.removed = True
                self._to_drop += self._drop_if_unused(adapter)

    def take_drops(self) -> list[int]:
        with self._lock:
            drops, self._to_drop = self._to_drop, []
            return drops

    def workers_replaced(self) -> None:
        """Fresh workers hold no slots (the requests that used them failed)."""
        with self._lock:
            self.slots.reset()

    def _drop_if_unused(self, adapter: Adapter) -> list[int]:
        if not adapter.removed or adapter.pins > 0:
            return []
        self._by_id.pop(adapter.id, None)
        self.slots.forget(adapter.id)
        return [adapter.id]

    # -- stats ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"registered": len(self._by_name), "slots_used": self.slots.used,
                    "slots": len(self.slots.adapters), "loads": self.slots.loads,
                    "evictions": self.slots.evictions}

    def requests_by_name(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests_by_name)


__all__ = ["Adapter", "AdapterRegistry", "LoraExistsError", "LoraInfo"]
