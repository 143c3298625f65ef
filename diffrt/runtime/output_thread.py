"""The output rank's writer: copies runner outputs into arena slots.

Async path (two-phase output): the worker's main thread records an
event on the compute stream after forward, hands ``(outputs, event)`` to the
background thread and sends COMPUTE_DONE at once. The thread makes its side
stream wait on that event, enqueues ``platform.copy_async`` of every tensor
into its slot, records its own event and waits until the copies landed
(``platform.wait_copied``: only then are the bytes in shared memory), and
sends OUTPUT_READY. It holds the source tensors until then, so the device
allocator cannot reuse them early.

The arena is page-locked in place where the platform can (``host_path``
"page-locked"), so each copy is a real asynchronous DMA into shared memory.
Where it cannot but pinned buffers exist ("staged"), copies go through reused
pinned staging buffers and a host memcpy on this thread (``StagedCopier``).
Otherwise ("pageable") the copy goes straight to pageable memory, which blocks
the output thread, though still not the main one.

Where the platform has no usable events and outputs are device memory, the
copy runs synchronously on the main thread (never "copy anyway and hope").
On plain CPU there is nothing to wait for; packing still runs in the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from diffrt import tracing
from diffrt.platforms.interface import Platform, output_path, outputs_are_host_memory
from diffrt.runtime.messages import (
    PENDING_NOTICE_S,
    FreeSlots,
    KeyOutput,
    OutputPending,
    OutputReady,
)
from diffrt.runtime.shm_transport import (
    Arena,
    ArenaFullError,
    PackPlan,
    SlotAllocator,
    copy_host,
)
from diffrt.runtime.staged_copy import StagedCopier

logger = logging.getLogger(__name__)

#: blocking source of slot frees: ``wait(timeout) -> FreeSlots | None``
FreeSource = Callable[[float], "FreeSlots | None"]


MAX_CANCELLED_IDS = 4096


class OutputWriterClosed(RuntimeError):
    pass


class OutputWriter:
    """Packs outputs into the arena on a background thread (or synchronously)."""

    def __init__(self, platform: Platform, arena: Arena, free_source: FreeSource,
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
        # The arena page-locked where the platform can: a device-to-host copy
        # into pageable memory is staged by the driver and blocks the issuing
        # thread, which is not the asynchronous copy this writer is for.
        self._registration = None
        self._staging: StagedCopier | None = None
        if not self._host_outputs:
            self._registration = platform.register_host_memory(arena.bytes_view(0, arena.size))
        #: how outputs reach host memory: "host" (cpu), "page-locked", "staged" or "pageable"
        self.host_path = output_path(platform, self._registration is not None)
        if self.host_path == "staged":
            self._staging = StagedCopier(platform)
        elif self.host_path == "pageable":
            logger.info("%s can neither page-lock the output arena nor pin buffers: "
                        "device-to-host copies go to pageable memory", platform.name)
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
        if self._registration is not None and not self._thread.is_alive():
            # only once no copy can still be landing in it
            self.platform.unregister_host_memory(self._registration)
            self._registration = None

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
        if self._host_outputs:
            return copy_host
        if sync:  # on the compute stream; _pack_run synchronises after the run
            return lambda dst, src: self.platform.copy_async(dst, src, None)
        stream, staging = self._side_stream, self._staging
        if staging is not None:
            return lambda dst, src: staging.copy(dst, src, stream)
        return lambda dst, src: self.platform.copy_async(dst, src, stream)

    def _pack(self, batch_id: str, ids: dict[str, str], outputs: dict[str, Any],
              event: Any, sync: bool) -> None:
        """Copy ``outputs`` into the arena and send OUTPUT_READY for them.

        Async path: outputs go in the largest runs that fit the arena now, each
        sent as soon as it is copied, so their consumers can read (and free)
        them while the rest waits for room; an output released meanwhile is
        skipped, and one larger than the whole arena fails alone. Synchronous
        path (before COMPUTE_DONE, so nobody can read a first part yet): all
        outputs of the call at once, or ArenaFullError when they can never fit.
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
            except Exception as exc:
                self._send(self._failed(batch_id, list(ids.values()), exc, sync))
                return
            self._drain_frees(0.0)
            plans: list[tuple[str, PackPlan]] = []
            for key, value in outputs.items():
                try:
                    plans.append((ids[key], PackPlan(value)))
                except Exception as exc:  # an output that cannot be packed fails alone
                    self._send(self._failed(batch_id, [ids[key]], exc, sync))
            while plans := self._without_released(batch_id, plans):
                try:
                    if sync:
                        slots = self._allocate([plan.slot_bytes for _, plan in plans])
                    else:
                        slots = self._allocate_run(batch_id, plans)
                except ArenaFullError as exc:  # the first output(s) can never fit
                    n = len(plans) if sync else 1
                    self._send(self._failed(batch_id, [oid for oid, _ in plans[:n]], exc, sync))
                    plans = plans[n:]
                    continue
                run, plans = plans[:len(slots)], plans[len(slots):]
                self._send(self._pack_run(batch_id, run, slots, copy, event, sync))

    def _without_released(self, batch_id: str,
                          plans: list[tuple[str, PackPlan]]) -> list[tuple[str, PackPlan]]:
        """Drop the outputs released before they were copied (and say so)."""
        keep, skipped = [], []
        for oid, plan in plans:
            if self._cancelled.pop(oid, "live") is None:
                skipped.append(oid)
            else:
                keep.append((oid, plan))
        if skipped:
            self._send(OutputReady(batch_id, [], skipped_ids=skipped))
        return keep

    def _pack_run(self, batch_id: str, plans: list[tuple[str, PackPlan]],
                  slots: list[tuple[int, int]], copy: Callable[[torch.Tensor, torch.Tensor], None],
                  event: Any, sync: bool) -> OutputReady:
        done: list[KeyOutput] = []
        try:
            for (oid, plan), (offset, gen) in zip(plans, slots, strict=True):
                self._slot_of[oid] = (offset, gen)
                self._id_at[offset] = oid
                done.append(plan.key_output(oid, offset, gen))
            for (_, plan), (offset, _) in zip(plans, slots, strict=True):
                plan.copy_into(self.arena, offset, copy)
            if sync and not self._host_outputs:
                self.platform.synchronize()
            elif event is not None:
                copied = self.platform.record_device_event(self._side_stream)
                if copied is None:
                    raise RuntimeError(f"platform {self.platform.name} stopped giving events")
                self.platform.wait_copied(copied, self._side_stream)
                if self._staging is not None:
                    self._staging.finish()
            return OutputReady(batch_id, done)  # the bytes are in the arena only now
        except Exception as exc:
            for offset, gen in slots:
                self._free(offset, gen)
            failed = self._failed(batch_id, [oid for oid, _ in plans], exc, sync)
            if self._staging is not None:
                self._staging.discard()  # after _failed quiesced the side stream
            return failed

    def _failed(self, batch_id: str, oids: list[str], exc: Exception, sync: bool) -> OutputReady:
        if self._side_stream is not None and not sync:
            self._quiesce_side_stream()  # no late copy may land in a reused slot
        logger.warning("packing output %s failed: %s", batch_id, exc, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return OutputReady(batch_id, [], error=f"{type(exc).__name__}: {first}",
                           failed_ids=oids)

    def _quiesce_side_stream(self) -> None:
        try:
            ev = self.platform.record_device_event(self._side_stream)
            if ev is not None:  # "landed", not just "event done" (XPU)
                self.platform.wait_copied(ev, self._side_stream)
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

    def _allocate_run(self, batch_id: str,
                      plans: list[tuple[str, PackPlan]]) -> list[tuple[int, int]]:
        """Slots for the longest prefix of ``plans`` that fits now, at least one:
        waits for frees while none fits, telling the executor every
        ``PENDING_NOTICE_S`` that these outputs wait for room (a consumer that
        does not read is not a lost output). Raises ArenaFullError when the first
        can never fit."""
        notice_at = 0.0  # the first notice as soon as it has to wait
        waited = False
        while True:
            slots = []
            for _, plan in plans:
                slot = self._alloc.try_allocate(plan.slot_bytes)
                if slot is None:
                    break
                slots.append(slot)
            if slots:
                if waited:
                    logger.debug("output arena had room again for %s", batch_id)
                return slots
            if self._closed.is_set():
                raise OutputWriterClosed("output writer closed while waiting for arena space")
            waited = True
            if time.monotonic() >= notice_at:
                self._send(OutputPending(batch_id, [oid for oid, _ in plans]))
                notice_at = time.monotonic() + PENDING_NOTICE_S
            self._drain_frees(0.2)

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


__all__ = ["ArenaFullError", "OutputWriter", "OutputWriterClosed", "outputs_are_host_memory"]
