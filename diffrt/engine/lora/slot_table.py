"""Which adapter sits in which device slot: the engine's side of ``max_loras``.

The workers hold at most ``max_loras`` adapters on the device
(``row_lora.RowLoras``); this table decides which, when the scheduler admits
a request (``admit``): an adapter already in a slot is used there, else it
takes an empty slot or evicts the least recently used one no running request
uses. A request whose adapters find no slot is not admitted: it waits in its
place for a later tick (a slot frees when the requests using it end,
``release``). Once one request waits for a slot, no later request that needs
a slot is admitted in the same pass (requests without adapters still are),
so the slots drain towards the one that waits instead of staying busy with
younger traffic.

The assignments made since the last tick travel with the next execute
(``take_installs``); the worker copies the adapter from host memory into the
slot before that tick's steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class SlotTable:
    """Adapter ids in ``slots`` device slots, with their users and recency."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {slots}")
        self.adapters: list[int | None] = [None] * slots
        self.users = [0] * slots
        self._used_at = [0] * slots
        self._clock = itertools.count(1)
        self._installs: dict[int, int] = {}
        #: counters since start (the engine's stats)
        self.loads = 0
        self.evictions = 0

    def slot_of(self, adapter_id: int) -> int | None:
        try:
            return self.adapters.index(adapter_id)
        except ValueError:
            return None

    @property
    def used(self) -> int:
        return sum(a is not None for a in self.adapters)

    def fits(self, adapter_ids: Iterable[int]) -> bool:
        """``acquire`` would find slots for ``adapter_ids`` now (nothing changes)."""
        ids = list(adapter_ids)
        missing = [a for a in ids if self.slot_of(a) is None]
        keep = {self.slot_of(a) for a in ids} - {None}
        free = [s for s in range(len(self.adapters)) if self.users[s] == 0 and s not in keep]
        return len(missing) <= len(free)

    def acquire(self, adapter_ids: Iterable[int]) -> list[int] | None:
        """Slots for ``adapter_ids`` (one each, in order), each then counting
        one more user; None, and nothing changed, when they do not all fit."""
        ids = list(adapter_ids)
        missing = [a for a in ids if self.slot_of(a) is None]
        keep = {self.slot_of(a) for a in ids} - {None}
        free = sorted((s for s in range(len(self.adapters))
                       if self.users[s] == 0 and s not in keep),
                      key=lambda s: (self.adapters[s] is not None, self._used_at[s]))
        if len(missing) > len(free):
            return None
        for adapter_id, slot in zip(missing, free, strict=False):
            if self.adapters[slot] is not None:
                self.evictions += 1
            self.adapters[slot] = adapter_id
            self._installs[slot] = adapter_id
            self.loads += 1
        slots = [self.adapters.index(a) for a in ids]
        now = next(self._clock)
        for slot in slots:
            self.users[slot] += 1
            self._used_at[slot] = now
        return slots

    def release(self, slots: Iterable[int]) -> None:
        """One user fewer for each of ``slots`` (a request using them ended)."""
        now = next(self._clock)
        for slot in slots:
            self.users[slot] = max(0, self.users[slot] - 1)
            self._used_at[slot] = now

    def forget(self, adapter_id: int) -> None:
        """``adapter_id`` was dropped: its slot (no longer used) is empty now."""
        slot = self.slot_of(adapter_id)
        if slot is not None:
            self.adapters[slot] = None
            self._installs.pop(slot, None)

    def empty(self, slots: Iterable[int]) -> None:
        """The workers hold nothing in ``slots`` (an install failed there):
        assign them anew when next needed (their users, failing, release them)."""
        for slot in slots:
            if 0 <= slot < len(self.adapters):
                self.adapters[slot] = None
                self._installs.pop(slot, None)

    def take_installs(self) -> dict[int, int]:
        """Slot -> adapter id assigned since the last call (for the next execute)."""
        installs, self._installs = self._installs, {}
        return installs

    def reset(self) -> None:
        """The workers were replaced: their slots are empty (nobody uses them now)."""
        self.adapters = [None] * len(self.adapters)
        self.users = [0] * len(self.users)
        self._installs.clear()


__all__ = ["SlotTable"]
