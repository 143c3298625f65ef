"""The output rank's writer: copies runner outputs into arena slots.

Async path (two-phase output): the worker's main thread records an
event on the compute stream after forward, hands ``(outputs, event)`` to the
background thread and sends COMPUTE_DONE at once. The thread makes its side
stream wait on that event, enqueues ``platform.copy_async`` of every tensor
into its slot, records and synchronises its own event (only then are the
bytes in shared memory), and sends OUTPUT_READY. It holds the source tensors
until that event completed, so the device allocator cannot reuse them early.

Where the platform has no usable events and outputs are device memory, the
copy runs synchronously on the main thread (never "copy anyway and hope").
On plain CPU there is nothing to wait for; packing still runs in the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from diffrt import tracing
from diffrt.runtime.messages import FreeSlots, KeyOutput, OutputReady
from diffrt.runtime.shm_transport import Arena, ArenaFullError, PackPlan, SlotAllocator

logger = logging.getLogger(__name__)

#: blocking source of slot frees: ``wait(timeout) -> FreeSlots | None``
FreeSource = Callable[[float], "FreeSlots | None"]


MAX_CANCELLED_IDS = 4096


class OutputWriterClosed(RuntimeError):
    pass


def outputs_are_host_memory(platform: Any) -> bool:
    """True where forward's outputs are already host memory (the CPU platform):
    no event is needed before reading them."""
    return platform.name == "cpu"


class OutputWriter:
    """Packs outputs into the arena on a background thread (or synchronously)."""

    def __init__(self, platform: Any, arena: Arena, free_source: FreeSource,
                 send: Callable[[Any], None], *, rank: int = 0, queue_depth: int = 2,
                 async_output: bool = True):
        self.platform = platform
        self.arena = arena
        self._free_source = free_source
        self._send = send
        self._rank = rank
        self._alloc = SlotAllocator(arena.size)
        self._slot_of: dict[str, tuple[int, int]] = {}  # live output id -> (offset, generation)
        self._id_at: dict[int, str] = {}                # slot offset -> output id
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # freed before being packed
        self._async = async_output and bool(getattr(platform, "supports_async_output", False))
        self._host_outputs = outputs_are_host_memory(platform)
        self._closed = threading.Event()
        self._pack_lock = threading.Lock()  # the allocator is used by one packer at a time
        self._side_stream: Any = None
        self._queue: queue.Queue[tuple | None] = queue.Queue(maxsize=queue_depth)
        self._thread = threading.Thread(target=self._run, name=f"diffrt-output-{rank}", daemon=True)
        self._thread.start()

    # -- main thread -------------------------------------------------------------
    def submit(self, batch_id: str, ids: dict[str, str], outputs: dict[str, Any]) -> bool:
        """Start moving ``outputs`` off the device. Returns True when they took the
        async path (OUTPUT_READY follows later), False when they were copied
        synchronously (OUTPUT_READY already sent)."""
        event = None
        if self._async:
            event = self.platform.record_device_event()
            if event is None and not self._host_outputs:
                logger.debug("platform %s gave no event: synchronous output copy", self.platform.name)
        if self._async and (event is not None or self._host_outputs):
            item = (batch_id, ids, outputs, event)
            while not self._closed.is_set():
                try:
                    # Bounded: a stuck writer (full arena) throttles the main thread.
                    self._queue.put(item, timeout=0.2)
                    return True
                except queue.Full:
                    continue
            raise OutputWriterClosed("output writer closed")
        self._pack(batch_id, ids, outputs, event=None, sync=True)
        return False

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    # -- output thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception:
            logger.exception("output thread of rank %d failed", self._rank)
        finally:
            # Whatever ended the thread, nothing may wait on it: submit() stops
            # blocking, and every output still queued fails now, not at a timeout.
            self._closed.set()
            self._fail_queued("the output thread stopped before copying this output")

    def _fail_queued(self, reason: str) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            batch_id, ids, _, _ = item
            try:
                self._send(OutputReady(batch_id, [], error=reason, failed_ids=list(ids.values())))
            except Exception:  # channel gone: the executor fails everything itself
                return

    def _serve(self) -> None:
        track = tracing.worker_output_track(self._rank)
        while not self._closed.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                with self._pack_lock:  # idle: keep the free channel drained
                    self._drain_frees(0.0)
                continue
            if item is None:
                break
            batch_id, ids, outputs, event = item
            try:
                with tracing.span(track, tracing.COPY_SPAN, output_id=batch_id,
                                  keys=list(outputs)):
                    self._pack(batch_id, ids, outputs, event=event, sync=False)
            except Exception:  # channel gone: the executor is dying
                logger.debug("could not send OUTPUT_READY %s", batch_id, exc_info=True)
                break
            finally:
                del item, outputs  # the sources may be reused only after the copy completed

    def _copy_fn(self, sync: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
        if sync or self._host_outputs:
            return lambda dst, src: dst.copy_(src)
        stream = self._side_stream
        return lambda dst, src: self.platform.copy_async(dst, src, stream)

    def _pack(self, batch_id: str, ids: dict[str, str], outputs: dict[str, Any],
              event: Any, sync: bool) -> None:
        """Copy ``outputs`` into the arena and send OUTPUT_READY for them.

        A batch goes in chunks that each fit the arena: a chunk waits for room
        only after the previous one was sent, so its consumers can read (and
        free) it meanwhile. A batch larger than the whole arena is therefore
        delivered piece by piece instead of failing; only a single output
        larger than the arena fails (ArenaFullError, that output alone).
        """
        with self._pack_lock:
            try:
                if sync and not self._host_outputs:
                    self.platform.synchronize()  # outputs complete before a blocking copy
                elif event is not None:
                    if self._side_stream is None:
                        self._side_stream = self.platform.new_side_stream()
                    self.platform.wait_event(self._side_stream, event)
                copy = self._copy_fn(sync)
                self._drain_frees(0.0)
                skipped: list[str] = []
                plans: list[tuple[str, PackPlan]] = []
                for key, value in outputs.items():
                    oid = ids[key]
                    if self._cancelled.pop(oid, "live") is None:
                        skipped.append(oid)  # released before it was packed: never copied
                    else:
                        plans.append((oid, PackPlan(value)))
            except Exception as exc:
                self._send(self._failed(batch_id, list(ids.values()), exc, sync))
                return
            if skipped or not plans:
                self._send(OutputReady(batch_id, [], skipped_ids=skipped))
            for chunk in _chunks(plans, self.arena.size):
                self._send(self._pack_chunk(batch_id, chunk, copy, event, sync))

    def _pack_chunk(self, batch_id: str, plans: list[tuple[str, PackPlan]],
                    copy: Callable[[torch.Tensor, torch.Tensor], None], event: Any,
                    sync: bool) -> OutputReady:
        done: list[KeyOutput] = []
        try:
            slots = self._allocate([plan.slot_bytes for _, plan in plans])
            for (oid, plan), (offset, gen) in zip(plans, slots, strict=True):
                self._slot_of[oid] = (offset, gen)
                self._id_at[offset] = oid
                done.append(plan.key_output(oid, offset, gen))
            for (_, plan), (offset, _) in zip(plans, slots, strict=True):
                plan.copy_into(self.arena, offset, copy)
            if event is not None and not sync:
                copied = self.platform.record_device_event(self._side_stream)
                if copied is None:
                    raise RuntimeError(f"platform {self.platform.name} stopped giving events")
                self.platform.event_synchronize(copied)  # bytes are in the arena only now
            return OutputReady(batch_id, done)
        except Exception as exc:
            for k in done:
                self._free(k.slot_offset, k.generation)
            return self._failed(batch_id, [oid for oid, _ in plans], exc, sync)

    def _failed(self, batch_id: str, oids: list[str], exc: Exception, sync: bool) -> OutputReady:
        if self._side_stream is not None and not sync:
            self._quiesce_side_stream()  # no late copy may land in a reused slot
        logger.warning("packing output %s failed: %s", batch_id, exc)
        return OutputReady(batch_id, [], error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                           failed_ids=oids)

    def _quiesce_side_stream(self) -> None:
        try:
            ev = self.platform.record_device_event(self._side_stream)
            if ev is not None:
                self.platform.event_synchronize(ev)
            else:
                self.platform.synchronize()
        except Exception:
            logger.exception("could not wait for the side stream; synchronising the device")
            self.platform.synchronize()

    def _drain_frees(self, timeout: float) -> None:
        msg = self._free_source(timeout)
        while msg is not None:
            for offset, gen in msg.slots:
                self._free(offset, gen)
            for oid in msg.ids:
                slot = self._slot_of.get(oid)
                if slot is not None:
                    self._free(*slot)
                else:  # not packed yet (or never will be): skip it when it comes
                    self._cancelled[oid] = None
                    while len(self._cancelled) > MAX_CANCELLED_IDS:
                        self._cancelled.popitem(last=False)
            msg = self._free_source(0.0)

    def _free(self, offset: int, gen: int) -> None:
        if self._alloc.free(offset, gen):
            oid = self._id_at.pop(offset, None)
            if oid is not None:
                self._slot_of.pop(oid, None)

    def _allocate(self, sizes: list[int]) -> list[tuple[int, int]]:
        """One slot per size, consecutive; waits for the executor to free slots when
        the arena is full (backpressure). Raises ArenaFullError if they can never fit."""
        waited = False
        while True:
            slots = self._alloc.try_allocate_many(sizes)
            if slots is not None:
                if waited:
                    logger.debug("output arena had room again for %d bytes", sum(sizes))
                return slots
            if self._closed.is_set():
                raise OutputWriterClosed("output writer closed while waiting for arena space")
            waited = True
            self._drain_frees(0.2)

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes


def _chunks(plans: list[tuple[str, PackPlan]], capacity: int) -> list[list[tuple[str, PackPlan]]]:
    """Consecutive groups of plans whose slots fit ``capacity`` together (a plan
    larger than ``capacity`` forms a group of its own, which then fails)."""
    groups: list[list[tuple[str, PackPlan]]] = []
    size = 0
    for item in plans:
        n = item[1].slot_bytes
        if not groups or size + n > capacity:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


__all__ = ["ArenaFullError", "OutputWriter", "OutputWriterClosed", "outputs_are_host_memory"]
