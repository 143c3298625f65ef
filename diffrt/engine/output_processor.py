"""OutputProcessor: from tick results to each request's output stream.

It holds the active requests' records and streams. For every ``TickResult``
of the core it records metrics, emits progress, applies the aborts the core
decided, and for a finished request registers a callback on its output's
future (the ``OutputRef`` the tick carries: the output processor never holds
the executor). When the output lands
in host memory it is not copied or converted: a ``FinalSlot`` holding its
lease goes on the stream, and the consumer's own read post-processes it (to
PIL) and frees its slot. Unread outputs therefore stay in the shared-memory
arena, which ``max_pending_output_bytes`` bounds: a slow consumer throttles the
worker instead of growing the engine's memory. Every stream put goes through
one FIFO delivery thread, so the tick loop never waits on a consumer and a
request's outputs keep their order (progress before final).

Lifecycle and delivery are separate: a record always reaches a terminal output
(``_finalize_locked``, exactly once); the stream is only where outputs go while
someone listens. A consumer that goes away removes its stream and frees its
unread output, nothing else.

Locking: one lock guards records, streams and pending slots. Output releases
and waits (executor calls, which may write to a pipe), stream puts and slot expiry happen after it is
released, and it is never held together with the core's lock. A slot's own
lock may be held when this lock is taken (a consumer completing its output),
never the other way round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from diffrt.engine.errors import EngineClosedError, EngineDeadError
from diffrt.engine.output_ref import OutputRef
from diffrt.engine.output_streams import FinalSlot, OutputStream
from diffrt.engine.outputs import DiffusionOutput, Rollout, split_rollout
from diffrt.engine.postprocess import PostProcess, encode_clips, take_sound
from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.sched import AbortOutcome, Finished
from diffrt.engine.stats import StatsRecorder
from diffrt.engine.tick import AbortNotice, TickResult
from diffrt.runtime.shm_transport import OutputLease

if TYPE_CHECKING:
    from PIL.Image import Image

logger = logging.getLogger(__name__)

#: How long close() waits for the delivery thread to drain.
DELIVERY_JOIN_S = 5.0


class OutputProcessor:
    def __init__(self, postprocess: PostProcess, *, workers: int,
                 unread_output_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 stats: StatsRecorder | None = None,
                 on_end: Callable[[RequestRecord], None] | None = None):
        self.stats = stats or StatsRecorder()
        #: called once a record is terminal or discarded, whatever the ending
        #: (the engine frees its input images there); twice is harmless
        self._on_end = on_end
        self._post = postprocess
        self._clock = clock
        self._unread_timeout = unread_output_timeout_s
        self._lock = threading.Lock()
        self._records: dict[str, RequestRecord] = {}
        self._streams: dict[str, OutputStream] = {}
        self._pending: dict[str, FinalSlot] = {}   # landed outputs not yet taken
        self._closed: str | None = None     # why new work is refused
        self._dead = False
        #: post-processing for asyncio consumers (their event loop must not block).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="diffrt-postprocess")
        self._deliveries: queue.SimpleQueue = queue.SimpleQueue()
        self._delivery = threading.Thread(target=self._deliver_loop,
                                          name="diffrt-engine-delivery", daemon=True)
        self._delivery.start()

    # -- requests in ---------------------------------------------------------------
    def add(self, records: list[RequestRecord], loop: asyncio.AbstractEventLoop | None,
            inbox: queue.SimpleQueue | None = None) -> list[OutputStream]:
        """Register records and open their streams (all or none)."""
        with self._lock:
            if self._closed is not None:
                if self._dead:
                    raise EngineDeadError(f"engine is not healthy: {self._closed}")
                raise EngineClosedError("engine is closed")
            for record in records:
                if record.request_id in self._records:
                    raise InvalidRequestError(
                        "request_id", f"{record.request_id!r} is already active")
            streams = []
            for record in records:
                stream = OutputStream(record.request_id, loop, inbox)
                self._records[record.request_id] = record
                self._streams[record.request_id] = stream
                streams.append(stream)
        return streams

    def discard(self, records: list[RequestRecord]) -> None:
        """Forget records the core refused (never scheduled; no output emitted)."""
        with self._lock:
            for record in records:
                if self._records.get(record.request_id) is record:
                    del self._records[record.request_id]
                    if self._on_end is not None:
                        self._on_end(record)
                    stream = self._streams.pop(record.request_id, None)
                    if stream is not None:
                        stream.close()

    def detach(self, stream: OutputStream) -> None:
        """A consumer went away: forget its stream and free its unread output;
        the request's lifecycle goes on."""
        stream.close()
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
            slot = self._pending.get(stream.request_id)
        if slot is not None and slot.stream is stream:
            self._expire(slot, "output released: its consumer went away")

    # -- what happened ---------------------------------------------------------------
    def on_tick(self, result: TickResult) -> None:
        """Apply one tick or abort (the core calls this: its loop thread, the
        caller of an abort, its timer)."""
        for notice in result.aborts:
            self._on_abort(notice)
        if not result.scheduled_ids and not result.finished:
            return  # nothing ran (an abort's report, a restart's first step)
        to_wait: list[tuple[str, OutputRef]] = []
        to_preview: list[tuple[str, OutputRef, int]] = []
        to_release: list[OutputRef] = []
        self.stats.on_tick(result.step_seconds, result.text_encoding, result.steps,
                           rows=result.step_rows, tokens=result.step_tokens)
        with self._lock:
            for rid in result.scheduled_ids:
                record = self._records.get(rid)
                if record is not None:
                    record.forward_time += result.elapsed
            for rid, cuts in result.prompt_tokens_dropped.items():
                record = self._records.get(rid)
                if record is not None:
                    record.metrics.prompt_tokens_dropped = dict(cuts)
            for rid, cache in result.cache.items():
                record = self._records.get(rid)
                if record is not None:
                    record.metrics.cache = cache
            for p in result.progress:
                if p.request_id in self._records:
                    self._emit_locked(p.request_id, DiffusionOutput(
                        p.request_id, step=p.step, total_steps=p.total_steps))
            for event in result.finished:
                oid = result.outputs.get(event.request_id)
                record = self._records.get(event.request_id)
                if record is None:  # aborted or closed meanwhile
                    if oid is not None:
                        to_release.append(oid)
                elif event.status is not RequestStatus.FINISHED:
                    self._finalize_locked(event.request_id, terminal_output(event))
                elif oid is None:
                    self._finalize_locked(event.request_id, DiffusionOutput(
                        event.request_id, finished=True, error="runner reported no output id",
                        step=event.step, total_steps=event.total_steps))
                else:
                    record.output = oid
                    record.compute_done_at = self._clock()
                    to_wait.append((event.request_id, oid))
            for rid, (oid, index) in result.previews.items():
                if rid in self._streams and not self._records[rid].aborted:
                    to_preview.append((rid, oid, index))
                else:  # nobody to show it to
                    to_release.append(oid)
        for ref in to_release:
            ref.release()
        for rid, ref, index in to_preview:
            ref.ready().add_done_callback(functools.partial(self._on_preview, rid, index))
        for rid, ref in to_wait:
            ref.ready().add_done_callback(functools.partial(self._on_output, rid, ref))

    def _on_abort(self, notice: AbortNotice) -> None:
        """The core decided an abort: late outputs of the request are dropped
        and ``notice.reason`` (an expired limit) becomes its error instead of
        "aborted". Ended at once when the scheduler ended it (``DONE``), when it
        had left the scheduler already (its output is computed: freed), or when
        a limit expired (answered now although a forward in flight cannot be
        interrupted); a user's abort of a request in flight ends with its tick."""
        rid = notice.request_id
        slot = None
        with self._lock:
            active = self._records.get(rid)
            if active is None or (notice.record is not None and active is not notice.record):
                return
            if notice.reason is not None and rid in self._pending:
                return  # its output landed: the consumer is reading it
            if not active.aborted:
                active.aborted = True
                active.abort_reason = notice.reason
            if notice.outcome is AbortOutcome.DONE:
                assert notice.event is not None
                self._finalize_locked(rid, terminal_output(notice.event))
                return
            if notice.outcome is not AbortOutcome.UNKNOWN and notice.reason is None:
                return  # in flight: the tick ends it at the next step boundary
            slot = self._pending.get(rid)
            output = DiffusionOutput(rid, finished=True, aborted=True, step=active.step,
                                     total_steps=active.total_steps)
            ref = active.output
            if slot is None:
                self._finalize_locked(rid, output)
        if slot is not None:
            self._expire_with(slot, output)
        elif ref is not None:
            ref.release()

    def fail_all(self, reason: str, *, dead: bool) -> None:
        """Refuse new work from now on and end every active request with ``reason``."""
        with self._lock:
            if self._closed is None:
                self._closed, self._dead = reason, dead
            slots = list(self._pending.values())
            records = [r for r in self._records.values() if r.request_id not in self._pending]
            for record in records:
                self._finalize_locked(record.request_id, DiffusionOutput(
                    record.request_id, finished=True, error=reason, step=record.step,
                    total_steps=record.total_steps))
        for slot in slots:
            self._expire(slot, reason)
        for record in records:
            if record.output is not None:
                record.output.release()

    def expire_unread(self, now: float) -> None:
        """Housekeeping at ``now`` (the core's timer): frees outputs unread past
        ``unread_output_timeout_s``; their requests end with "output expired"."""
        with self._lock:
            unread = [] if self._unread_timeout is None else [
                slot for slot in self._pending.values()
                if now - slot.ready_at >= self._unread_timeout]
        for slot in unread:
            self._expire(slot, f"output expired: unread for {self._unread_timeout:g} s "
                               f"(unread_output_timeout_s={self._unread_timeout:g})",
                         timed_out=True)

    # -- outputs landing ------------------------------------------------------------------
    def _on_output(self, rid: str, ref: OutputRef, future: concurrent.futures.Future) -> None:
        """The output is in host memory (or lost). Runs in the executor's pump
        thread (or inline): it only queues a slot, the consumer converts it."""
        ready_at = self._clock()
        try:
            lease: OutputLease = future.result()
        except Exception as exc:
            with self._lock:
                record = self._records.get(rid)
                if record is not None and record.output is ref:
                    self._finalize_locked(rid, DiffusionOutput(
                        rid, finished=True, error=f"output lost: {type(exc).__name__}: {exc}",
                        step=record.step, total_steps=record.total_steps))
            return
        with self._lock:
            record = self._records.get(rid)
            wanted = record is not None and record.output is ref and not record.aborted
            stream = self._streams.get(rid) if wanted else None
            if stream is not None:
                assert record is not None
                slot = FinalSlot(rid, lease, functools.partial(self._complete, record,
                                                               ready_at=ready_at),
                                 ready_at, stream)
                self._pending[rid] = slot
                self._deliveries.put((stream, slot))
                return
            if wanted:  # nobody listens: the request ends without its image
                assert record is not None
                self._finalize_locked(rid, DiffusionOutput(
                    rid, finished=True, step=record.total_steps, total_steps=record.total_steps))
        lease.release()  # a late output of an aborted request, or nobody listening

    def _on_preview(self, rid: str, index: int, future: concurrent.futures.Future) -> None:
        """A preview is in host memory. Runs in the executor's pump thread (or
        inline in the core's loop): it only queues the conversion on the
        delivery thread, which converts it to PIL and puts it on the stream —
        off the threads the ticks depend on, and ahead of the final output,
        which lands (and is queued) later. A lost preview is skipped."""
        try:
            lease: OutputLease = future.result()
        except Exception as exc:
            logger.warning("preview %d of %s lost: %s", index, rid, exc)
            return
        with self._lock:
            record = self._records.get(rid)
            stream = self._streams.get(rid)
            if record is not None and stream is not None and not record.aborted:
                self._deliveries.put((stream, lambda: self._convert_preview(record, index,
                                                                           lease)))
                return
        lease.release()  # aborted or finished meanwhile, or nobody listening

    def _convert_preview(self, record: RequestRecord, index: int,
                         lease: OutputLease) -> DiffusionOutput | None:
        """The preview as a progress item (on the delivery thread); None when
        its request ended meanwhile or the conversion failed."""
        rid = record.request_id
        try:
            with self._lock:
                if self._records.get(rid) is not record or record.aborted:
                    return None
            params = record.request.sampling_params
            images, value = self._post(lease.take(), params.output_type)
            return DiffusionOutput(rid, step=params.preview_steps()[index],
                                   total_steps=record.total_steps,
                                   preview=images if images is not None else value,
                                   preview_index=index, fps=params.fps)
        except Exception:
            logger.exception("preview %d of %s failed", index, rid)
            return None
        finally:
            lease.release()

    def _complete(self, record: RequestRecord, lease: OutputLease,
                  ready_at: float) -> DiffusionOutput:
        """The consumer takes its output: post-process it, free its slot, end it.
        Runs in the consumer's thread (or the pool, for asyncio consumers):
        never on the engine's loop, so an MP4's encoding (output_type "mp4")
        does not hold up the next step."""
        rid = record.request_id
        params = record.request.sampling_params
        images = value = error = waveform = sample_rate = None
        rollout: Rollout | None = None
        start = self._clock()
        try:
            # An owned copy: PIL may keep referencing the buffer it was built
            # from, and the slot is reused as soon as it is released.
            taken, rollout = split_rollout(lease.take())
            taken, waveform, sample_rate = take_sound(taken)
            images, value = self._post(taken, params.output_type)
        except Exception as exc:
            logger.exception("post-processing failed for %s", rid)
            error = f"post-processing failed: {type(exc).__name__}: {exc}"
        finally:
            lease.release()
        encoded: list[bytes] | None = None
        if error is None and params.output_type == "mp4" and value is not None:
            try:  # the slot is free already: encoding holds no output memory
                encoded = encode_clips(value, params.fps or 1.0, waveform, sample_rate or 0)
            except Exception as exc:
                logger.exception("encoding failed for %s", rid)
                error, value = f"encoding failed: {type(exc).__name__}: {exc}", None
        done = self._clock()
        frames = None
        if params.num_frames is not None:  # a video: "pil" gives its frames per output
            frames, images = cast("list[list[Image]] | None", images), None
        output = DiffusionOutput(rid, finished=True, error=error,
                                 images=cast("list[Image] | None", images),
                                 output=encoded if encoded is not None else value,
                                 step=record.total_steps, total_steps=record.total_steps,
                                 frames=frames, fps=params.fps, waveform=waveform,
                                 sample_rate=sample_rate, rollout=rollout)
        with self._lock:
            record.metrics.output_wait = ready_at - (record.compute_done_at or ready_at)
            record.metrics.postprocess_time = done - start
            if self._records.get(rid) is record:
                self._finalize_locked(rid, output, deliver=False)
        return output

    def take_async(self, slot: FinalSlot) -> concurrent.futures.Future[DiffusionOutput]:
        """``slot.take()`` on the post-processing pool (for asyncio consumers);
        inline once the pool is closed (the engine closed: the slot has expired,
        taking it is instant)."""
        try:
            return self._pool.submit(slot.take)
        except RuntimeError:
            future: concurrent.futures.Future[DiffusionOutput] = concurrent.futures.Future()
            future.set_result(slot.take())
            return future

    def _expire(self, slot: FinalSlot, error: str, *, timed_out: bool = False) -> None:
        with self._lock:
            record = self._records.get(slot.request_id)
            step = record.total_steps if record is not None else 0
        self._expire_with(slot, DiffusionOutput(slot.request_id, finished=True, error=error,
                                                step=step, total_steps=step),
                          timed_out=timed_out)

    def _expire_with(self, slot: FinalSlot, output: DiffusionOutput, *,
                     timed_out: bool = False) -> None:
        if slot.expire(output):
            with self._lock:
                if self._pending.get(slot.request_id) is slot:
                    self._finalize_locked(slot.request_id, output, deliver=False,
                                          timed_out=timed_out)

    # -- delivery ---------------------------------------------------------------------------
    def _emit_locked(self, rid: str, output: DiffusionOutput) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            self._deliveries.put((stream, output))

    def _finalize_locked(self, rid: str, output: DiffusionOutput, *, deliver: bool = True,
                         timed_out: bool = False) -> None:
        """The one place a request becomes terminal: exactly one final output.
        ``deliver=False``: its consumer holds a FinalSlot that yields ``output``;
        ``timed_out``: a limit ended it (counted as a timeout, not an error)."""
        record = self._records.pop(rid, None)
        if record is None:
            return
        if self._on_end is not None:
            self._on_end(record)
        self._pending.pop(rid, None)
        if record.admitted_at is not None:
            record.metrics.queue_wait = record.admitted_at - record.arrival
        record.metrics.forward_time = record.forward_time if record.forward_time > 0 else None
        record.metrics.finished_time = self._clock()
        output.metrics = record.metrics
        output.seed = record.request.sampling_params.seed
        output.seeds = record.request.sampling_params.seeds
        output.weights_version, output.lora_versions = record.weights_version, record.lora_versions
        if record.abort_reason is not None and output.aborted:  # a limit ended it
            output.aborted, output.error, timed_out = False, record.abort_reason, True
        output.timed_out = timed_out
        _judge_deadline(record, output)
        self.stats.on_final(output)
        stream = self._streams.pop(rid, None)
        if deliver and stream is not None:
            self._deliveries.put((stream, output))

    def _deliver_loop(self) -> None:
        while (item := self._deliveries.get()) is not None:
            stream, output = item
            if callable(output):  # a preview, converted here (see _on_preview)
                output = output()
                if output is None:
                    continue
            if not stream.put(output):  # its consumer is gone
                self.detach(stream)

    # -- introspection and shutdown ------------------------------------------------------------
    def active_record(self, request_id: str) -> RequestRecord | None:
        """The record of an active request (None: unknown or ended)."""
        with self._lock:
            return self._records.get(request_id)

    def active_ids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def num_active(self) -> int:
        with self._lock:
            return len(self._records)

    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def unread_bytes(self) -> int:
        """Bytes of landed outputs no consumer has taken yet."""
        with self._lock:
            return sum(slot.nbytes for slot in self._pending.values())

    def output_id_of(self, request_id: str) -> str | None:
        """The id of the output on its way for an active request (diagnostics)."""
        with self._lock:
            record = self._records.get(request_id)
            ref = record.output if record is not None else None
            return ref.output_id if ref is not None else None

    def close(self) -> None:
        """Stop post-processing and delivery (after ``fail_all``)."""
        self._pool.shutdown(wait=True)  # takes in flight finish: a consumer gets its output
        self._deliveries.put(None)
        self._delivery.join(DELIVERY_JOIN_S)


def _judge_deadline(record: RequestRecord, output: DiffusionOutput) -> None:
    """Its priority, deadline and preemptions into its metrics, and whether it
    met the deadline (an aborted request is not judged)."""
    params, m = record.request.sampling_params, output.metrics
    m.priority, m.deadline_s, m.preemptions = params.priority, params.deadline_s, record.preemptions
    if params.deadline_s is None or output.aborted:
        return
    m.deadline_met = (output.ok and m.finished_time is not None
                      and m.finished_time - m.arrival_time <= params.deadline_s)


def terminal_output(event: Finished) -> DiffusionOutput:
    """The final output of a request that ended without an image."""
    return DiffusionOutput(
        event.request_id, finished=True,
        error=event.error if event.status is RequestStatus.FAILED else None,
        aborted=event.status is RequestStatus.ABORTED,
        step=event.step, total_steps=event.total_steps)
