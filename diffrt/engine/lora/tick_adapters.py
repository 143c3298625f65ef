"""The adapters' part in each engine tick, for the engine core.

The requests queued in the core hold their adapters (``pin_all``, all or
none, under the core's lock); each tick carries the slot assignments made
since the last one and the (slot, adapter, scale) rows of the requests it
admits (``attach``); the workers' reply names the slots that stayed empty
(``after_reply``), and a tick that raised may have left any of its slots
empty (``tick_failed``). Between ticks the workers forget the removed
adapters no request holds any more (``drop_unused``).

``TickAdapters(None)`` stands for a model that takes no adapters: every call
does nothing, so the core never asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.record import RequestRecord
from diffrt.engine.runner_messages import DropAdapters, TickReport
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.sched.interface import SchedulerOutput
from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)


class TickAdapters:
    """The core's view of an ``AdapterRegistry`` (None: no adapters)."""

    def __init__(self, registry: AdapterRegistry | None):
        self.registry = registry

    def pin_all(self, records: Sequence[RequestRecord]) -> None:
        """Resolve and hold the records' adapters (all or none: one removed
        since its submission was checked refuses the lot)."""
        if self.registry is None:
            return
        pinned = []
        try:
            for record in records:
                self.registry.pin(record)
                pinned.append(record)
        except InvalidRequestError:
            for record in pinned:
                self.registry.release(record)
            raise

    def attach(self, tick: SchedulerOutput,
               record_of: Callable[[str], RequestRecord | None]) -> None:
        """The slot assignments made since the last tick, and the adapters
        of the requests ``tick`` admits."""
        if self.registry is None:
            return
        tick.adapter_installs = self.registry.take_installs()
        for request in tick.new:
            record = record_of(request.request_id)
            if record is not None and record.adapter_slots:
                tick.request_adapters[request.request_id] = [
                    (slot, adapter_id, scale) for (slot, scale), (adapter_id, _)
                    in zip(record.adapter_slots, record.adapters, strict=True)]

    def after_reply(self, report: TickReport) -> None:
        """The slots the workers could not fill: assigned anew later."""
        if self.registry is not None:
            self.registry.slots_empty(list(report.empty_adapter_slots))

    def tick_failed(self, tick: SchedulerOutput) -> None:
        """A tick that raised may not have filled its slots: assign them anew."""
        if self.registry is not None and tick.adapter_installs:
            self.registry.slots_empty(list(tick.adapter_installs))

    def workers_replaced(self) -> None:
        if self.registry is not None:
            self.registry.workers_replaced()

    def drop_unused(self, executor: Executor) -> None:
        """Have the workers forget the removed adapters no request holds any more."""
        if self.registry is None:
            return
        ids = self.registry.take_drops()
        if not ids:
            return
        try:
            executor.collective_rpc(DropAdapters(ids))
        except Exception as exc:  # workers gone: nothing of theirs to free
            logger.warning("dropping LoRA adapters %s failed: %s", ids, exc)


__all__ = ["TickAdapters"]
