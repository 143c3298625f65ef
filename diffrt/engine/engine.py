"""DiffusionEngine: scheduler + executor + per-request output streams.

Follow one request:

1. ``generate`` / ``step_streaming`` validate it (``check_inputs``, duplicate
   id), register an ``OutputStream`` and a lifecycle record, and add it to the
   scheduler, all under one lock.
2. The busy loop (its own thread) asks the scheduler for a tick, calls
   ``executor.execute("execute_batch" | "execute_step", payload)`` which
   returns at COMPUTE_DONE, and applies the result with
   ``scheduler.update_from_output``. Progress goes to the stream at once.
3. For a finished request the loop only registers a callback on
   ``executor.wait_output_ready(output_id)`` and moves on to the next tick.
   When the output lands in host memory, a small thread pool takes it from the
   lease, runs the model's post-processing (to PIL) and puts the final output
   on the stream. The busy loop never waits for a copy or a PIL conversion.

Lifecycle and delivery are separate: the record (and the scheduler entry)
always reaches a terminal state; the stream is only where outputs go while
someone listens. A consumer that goes away removes its stream, nothing else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from diffrt import tracing
from diffrt.engine.config import EngineConfig, EngineMode
from diffrt.engine.output_streams import OutputStream
from diffrt.engine.outputs import DiffusionOutput, RequestMetrics
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import InvalidRequestError, SamplingParams
from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    Finished,
    RequestScheduler,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    StepScheduler,
    make_policy,
)
from diffrt.engine.worker_runner import BatchMeta, BatchPayload, StepMeta, StepPayload
from diffrt.runtime.executor import (
    Executor,
    ExecutorConfig,
    ExecutorDeadError,
    make_executor,
)

logger = logging.getLogger(__name__)

RUNNER_CLS = "diffrt.engine.worker_runner:PipelineRunner"
LOOP_TRACK = "engine loop"
POST_TRACK = "engine postprocess"
#: How long close() lets the current tick finish before shutting the executor.
CLOSE_GRACE_S = 5.0


class EngineError(RuntimeError):
    """The engine cannot take this request (closed, or its executor died)."""


class EngineClosedError(EngineError):
    pass


class EngineDeadError(EngineError):
    pass


class EngineWarmupError(EngineError):
    """The start-up request failed or did not finish within warmup_timeout_s."""


@dataclass
class _Record:
    """Lifecycle of one active request (engine side)."""

    request: DiffusionRequest
    metrics: RequestMetrics
    aborted: bool = False
    output_id: str | None = None
    compute_done_at: float | None = None
    forward_time: float = 0.0
    step: int = 0

    @property
    def total_steps(self) -> int:
        return self.request.sampling_params.num_inference_steps


class DiffusionEngine:
    """Serves one model; see the module docstring for the request path."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        scheduler: Scheduler | None = None,
        *,
        pipeline_cls: type | None = None,
        pre_process: Callable[[DiffusionRequest], DiffusionRequest] | None = None,
        post_process: Callable[[Any, str], tuple[list[Any] | None, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.mode = config.mode
        self._pipeline_cls = pipeline_cls or config.pipeline_class()
        self._pre = pre_process or self._pipeline_cls.pre_process
        self._post = post_process or self._pipeline_cls.post_process
        self._executor = executor
        self._clock = clock
        self._scheduler = scheduler or self._make_scheduler()
        self._method = "execute_step" if self.mode is EngineMode.STEP_BATCH else "execute_batch"
        self._cond = threading.Condition()
        self._records: dict[str, _Record] = {}
        self._streams: dict[str, OutputStream] = {}
        self._closed = False
        self._dead_reason: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.postprocess_workers, thread_name_prefix="diffrt-postprocess")
        # Every stream put goes through one FIFO delivery thread: the busy loop
        # only enqueues, so waking consumers never delays the next execute, and
        # a request's outputs keep their order (progress before final).
        self._deliveries: queue.SimpleQueue = queue.SimpleQueue()
        self._delivery = threading.Thread(target=self._deliver_loop,
                                          name="diffrt-engine-delivery", daemon=True)
        self._delivery.start()
        self._thread = threading.Thread(target=self._busy_loop, name="diffrt-engine-loop",
                                        daemon=True)
        self._thread.start()

    # -- construction ---------------------------------------------------------------
    @classmethod
    def make_engine(cls, config: EngineConfig, *, scheduler: Scheduler | None = None,
                    executor: Executor | None = None) -> DiffusionEngine:
        """Resolve the model's hooks, pick the mode, build executor and scheduler,
        warm up within ``config.warmup_timeout_s``; on any failure everything
        started so far is shut down before the error propagates."""
        from diffrt.engine.pipelines.registry import get_post_process_func, get_pre_process_func

        pipeline_cls = config.pipeline_class()
        pre, post = get_pre_process_func(config.model), get_post_process_func(config.model)
        if executor is None:
            executor = make_executor(config.executor_backend, executor_config(config))
        try:
            engine = cls(config, executor, scheduler, pipeline_cls=pipeline_cls,
                         pre_process=pre, post_process=post)
        except BaseException:
            executor.shutdown()
            raise
        if config.warmup:
            try:
                engine._warmup()
            except BaseException as exc:
                engine._shutdown(grace_s=0.0)  # a hung warm-up tick is not waited for
                if isinstance(exc, EngineWarmupError):
                    raise
                raise EngineWarmupError(f"warm-up failed: {exc}") from exc
        logger.info("engine ready: model=%s mode=%s max_num_seqs=%d executor=%s",
                    config.model, engine.mode.value, config.max_num_seqs,
                    config.executor_backend)
        return engine

    def _make_scheduler(self) -> Scheduler:
        c = self.config
        policy = make_policy(c.scheduling_policy, max_bypass=c.scheduling_max_bypass)
        if self.mode is EngineMode.STEP_BATCH:
            return StepScheduler(c.max_num_seqs, policy,
                                 max_wait_s=c.step_batch_max_wait_ms / 1000.0)
        wait_ms = c.request_batch_max_wait_ms if self._pipeline_cls.supports_request_batch else 0.0
        return RequestScheduler(c.max_num_seqs, policy, max_wait_s=wait_ms / 1000.0)

    def _warmup(self) -> None:
        multiple = int(getattr(self._pipeline_cls, "size_multiple", 16))
        largest = int(getattr(self._pipeline_cls, "max_size", 4096)) // multiple * multiple
        size = max(multiple, min(multiple * -(-64 // multiple), largest))  # ~64 px
        request = DiffusionRequest(
            prompt="warm-up", request_id=f"warmup-{uuid.uuid4().hex[:8]}",
            sampling_params=SamplingParams(height=size, width=size, num_inference_steps=1,
                                           seed=0),
        )
        start = time.monotonic()
        try:
            out = self.generate(request, timeout=self.config.warmup_timeout_s)
        except TimeoutError:
            raise EngineWarmupError(
                f"warm-up did not finish within warmup_timeout_s={self.config.warmup_timeout_s}"
            ) from None
        if not out.ok:
            raise EngineWarmupError(f"warm-up request failed: {out.error}")
        logger.info("warm-up done in %.2f s", time.monotonic() - start)

    # -- public API -------------------------------------------------------------------
    def generate(self, requests: DiffusionRequest | Sequence[DiffusionRequest], *,
                 timeout: float | None = None) -> DiffusionOutput | list[DiffusionOutput]:
        """Run requests to completion; one output, or a list in the same order.

        Raises InvalidRequestError (nothing submitted) for a bad request, and
        TimeoutError after ``timeout`` seconds (the unfinished requests are
        aborted).
        """
        single = isinstance(requests, DiffusionRequest)
        batch = [requests] if single else list(requests)
        streams = self._submit(batch, loop=None)
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs: list[DiffusionOutput] = []
        try:
            for stream in streams:
                outputs.append(self._final_of(stream, deadline))
        except BaseException:
            for stream in streams[len(outputs):]:
                self._detach(stream)
                self.abort(stream.request_id)
            raise
        return outputs[0] if single else outputs

    async def step_streaming(self, request: DiffusionRequest) -> AsyncIterator[DiffusionOutput]:
        """Yield the request's progress outputs, then its final output.

        Leaving early (break, cancellation) detaches this consumer only: the
        request still runs to its end and is cleaned up; use ``abort`` to stop it.
        """
        [stream] = self._submit([request], loop=asyncio.get_running_loop())
        finished = False
        try:
            while not finished:
                out = await stream.aget()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._detach(stream)

    async def generate_async(self, request: DiffusionRequest) -> DiffusionOutput:
        """The final output of ``step_streaming`` (for asyncio callers)."""
        final = None
        async for out in self.step_streaming(request):
            final = out
        assert final is not None
        return final

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request at the next step boundary and free
        its outputs. An unknown or finished id does nothing."""
        with self._cond:
            rec = self._records.get(request_id)
            if rec is None:
                return
            rec.aborted = True
            outcome, event = self._scheduler.abort(request_id)
            if outcome is AbortOutcome.DONE:
                self._finalize_locked(request_id, self._terminal_output(event))
            elif outcome is AbortOutcome.UNKNOWN:
                # Computed already; its output is on the way (or waiting to be read).
                if rec.output_id is not None:
                    self._executor.release_output(rec.output_id)
                self._finalize_locked(request_id, DiffusionOutput(
                    request_id, finished=True, aborted=True, step=rec.step,
                    total_steps=rec.total_steps))
            self._cond.notify_all()  # step mode: the loop sends the drop

    def is_healthy(self) -> bool:
        return (not self._closed and self._dead_reason is None and self._thread.is_alive()
                and self._executor.is_healthy())

    def close(self) -> None:
        """Refuse new work, send an error output to every open stream, stop the
        executor (idempotent)."""
        self._shutdown(CLOSE_GRACE_S)

    def _shutdown(self, grace_s: float) -> None:
        """close(), letting a tick in flight finish for up to ``grace_s``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            # Streams hear at once; a tick still in flight finds its requests
            # gone and frees whatever it produced.
            self._fail_all_locked("engine closed")
            self._cond.notify_all()
        self._thread.join(grace_s)
        if self._thread.is_alive():
            logger.warning("engine loop still busy after %.1f s; shutting the executor down",
                           grace_s)
        self._executor.shutdown()
        self._thread.join(CLOSE_GRACE_S)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._deliveries.put(None)
        self._delivery.join(CLOSE_GRACE_S)
        logger.info("engine closed")

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def num_active_requests(self) -> int:
        with self._cond:
            return len(self._records)

    # -- submission -----------------------------------------------------------------
    def _submit(self, requests: list[DiffusionRequest],
                loop: asyncio.AbstractEventLoop | None) -> list[OutputStream]:
        prepared = []
        seen: set[str] = set()
        for request in requests:
            if not isinstance(request, DiffusionRequest):
                raise InvalidRequestError("request", f"must be a DiffusionRequest, got {type(request).__name__}")
            self._pipeline_cls.check_inputs(request)
            request = self._pre(request)
            if request.request_id in seen:
                raise InvalidRequestError("request_id", f"{request.request_id!r} given twice")
            seen.add(request.request_id)
            prepared.append(request)
        now = self._clock()
        with self._cond:
            self._check_accepting_locked()
            for request in prepared:
                if request.request_id in self._records:
                    raise InvalidRequestError(
                        "request_id", f"{request.request_id!r} is already active")
            streams = []
            for request in prepared:
                rid = request.request_id
                stream = OutputStream(rid, loop)
                self._records[rid] = _Record(request, RequestMetrics(arrival_time=now))
                self._streams[rid] = stream
                self._scheduler.add_request(request, now)
                streams.append(stream)
            self._cond.notify_all()
        return streams

    def _check_accepting_locked(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._dead_reason is not None:
            raise EngineDeadError(f"engine is not healthy: {self._dead_reason}")
        if not self._executor.is_healthy():
            raise EngineDeadError("engine is not healthy: executor is down")

    def _final_of(self, stream: OutputStream, deadline: float | None) -> DiffusionOutput:
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"request {stream.request_id} did not finish in time")
            try:
                out = stream.get(timeout=remaining)
            except queue.Empty:
                continue
            if out.finished:
                return out

    def _detach(self, stream: OutputStream) -> None:
        """A consumer went away: forget its stream, keep the request's lifecycle."""
        stream.close()
        with self._cond:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    # -- busy loop --------------------------------------------------------------------
    def _busy_loop(self) -> None:
        tracing.process_name("engine")
        try:
            while True:
                sched_out = self._next_tick()
                if sched_out is None:
                    return
                self._run_tick(sched_out)
        except Exception as exc:  # a bug in the engine: fail everything, visibly
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {exc!r}")

    def _next_tick(self) -> SchedulerOutput | None:
        """Block until there is work (or the engine stops); None means stop."""
        with self._cond:
            while True:
                if self._closed or self._dead_reason is not None:
                    return None
                if self._scheduler.has_work():
                    now = self._clock()
                    wait = self._scheduler.admission_wait_s(now)
                    if wait <= 0:
                        out = self._scheduler.schedule(now)
                        if out is not None:
                            return out
                        wait = 0.05  # nothing schedulable yet; should not happen
                    self._cond.wait(wait)
                else:
                    self._cond.wait()

    def _run_tick(self, sched_out: SchedulerOutput) -> None:
        start = self._clock()
        with self._cond:
            for rid in sched_out.scheduled_ids:
                rec = self._records.get(rid)
                if rec is not None and rec.metrics.queue_wait is None:
                    rec.metrics.queue_wait = start - rec.metrics.arrival_time
        ro = None
        try:
            with tracing.span(LOOP_TRACK, self._method, keys=sched_out.scheduled_ids,
                              drop=sched_out.drop_ids):
                ro = self._executor.execute(self._method, self._payload(sched_out))
            result = self._result_of(sched_out, ro)
        except ExecutorDeadError as exc:
            self._die(f"executor died: {exc}")
            return
        except Exception as exc:  # the runner raised: this tick's requests fail
            logger.error("%s failed: %s", self._method, exc)
            result = ExecutionResult(failed_all=f"{type(exc).__name__}: {exc}")
        elapsed = self._clock() - start
        output_ids = dict(ro.output_ids) if ro is not None else {}
        with self._cond:
            update = self._scheduler.update_from_output(sched_out, result)
            for rid in sched_out.scheduled_ids:
                rec = self._records.get(rid)
                if rec is not None:
                    rec.forward_time += elapsed
            for p in update.progress:
                rec = self._records.get(p.request_id)
                if rec is not None:
                    rec.step = p.step
                    self._emit_locked(p.request_id, DiffusionOutput(
                        p.request_id, step=p.step, total_steps=p.total_steps))
            for event in update.finished:
                oid = output_ids.pop(event.request_id, None)
                self._on_terminal_locked(event, oid)
        for oid in output_ids.values():  # outputs nobody asked for
            self._executor.release_output(oid)

    def _payload(self, sched_out: SchedulerOutput) -> Any:
        if self.mode is EngineMode.STEP_BATCH:
            return StepPayload(new=sched_out.new, advance=sched_out.scheduled_ids,
                               drop=sched_out.drop_ids)
        return BatchPayload(requests=sched_out.new)

    def _result_of(self, sched_out: SchedulerOutput, ro: Any) -> ExecutionResult:
        if self.mode is EngineMode.STEP_BATCH:
            m = _convert(ro.meta, StepMeta)
            return ExecutionResult(progress=m.progress, finished=m.finished, errors=m.errors)
        m = _convert(ro.meta, BatchMeta)
        finished = [rid for rid in sched_out.scheduled_ids
                    if rid in ro.output_ids and rid not in m.errors]
        return ExecutionResult(finished=finished, errors=m.errors)

    # -- terminal handling ------------------------------------------------------------
    def _on_terminal_locked(self, event: Finished, output_id: str | None) -> None:
        rid = event.request_id
        rec = self._records.get(rid)
        if event.status is not RequestStatus.FINISHED or rec is None:
            if output_id is not None:
                self._executor.release_output(output_id)
            if rec is not None:
                self._finalize_locked(rid, self._terminal_output(event))
            return
        if output_id is None:
            self._finalize_locked(rid, DiffusionOutput(
                rid, finished=True, error="runner reported no output id",
                step=event.step, total_steps=event.total_steps))
            return
        rec.step = event.step
        rec.output_id = output_id
        rec.compute_done_at = self._clock()
        future = self._executor.wait_output_ready(output_id)
        future.add_done_callback(lambda f, rid=rid, oid=output_id: self._on_output(rid, oid, f))

    def _on_output(self, rid: str, oid: str, future: concurrent.futures.Future) -> None:
        """Runs in the executor's pump thread (or inline): hand off to the pool."""
        try:
            self._pool.submit(self._postprocess, rid, oid, future)
        except RuntimeError:  # pool shut down: the engine is closing
            _release_quietly(future)

    def _postprocess(self, rid: str, oid: str, future: concurrent.futures.Future) -> None:
        ready_at = self._clock()
        try:
            lease = future.result()
        except Exception as exc:
            with self._cond:
                rec = self._records.get(rid)
                if rec is not None and rec.output_id == oid:
                    self._finalize_locked(rid, DiffusionOutput(
                        rid, finished=True, error=f"output lost: {type(exc).__name__}: {exc}",
                        step=rec.step, total_steps=rec.total_steps))
            return
        with self._cond:
            rec = self._records.get(rid)
            wanted = rec is not None and rec.output_id == oid and not rec.aborted
            listening = wanted and rid in self._streams
        if not wanted:
            lease.release()  # a late output of an aborted request: drop it
            return
        images = output = error = None
        post_start = self._clock()
        if listening:
            try:
                with tracing.span(POST_TRACK, "postprocess", request_id=rid):
                    value = lease.take()
                    images, output = self._post(value, rec.request.sampling_params.output_type)
            except Exception as exc:
                logger.exception("post-processing failed for %s", rid)
                error = f"post-processing failed: {type(exc).__name__}: {exc}"
        lease.release()
        done = self._clock()
        with self._cond:
            rec = self._records.get(rid)
            if rec is None or rec.output_id != oid:
                return
            rec.metrics.output_wait = ready_at - (rec.compute_done_at or ready_at)
            rec.metrics.postprocess_time = done - post_start
            self._finalize_locked(rid, DiffusionOutput(
                rid, finished=True, error=error, aborted=rec.aborted, images=images,
                output=output, step=rec.total_steps, total_steps=rec.total_steps))

    def _terminal_output(self, event: Finished) -> DiffusionOutput:
        return DiffusionOutput(
            event.request_id, finished=True,
            error=event.error if event.status is RequestStatus.FAILED else None,
            aborted=event.status is RequestStatus.ABORTED,
            step=event.step, total_steps=event.total_steps)

    def _emit_locked(self, rid: str, output: DiffusionOutput) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            self._deliveries.put((stream, output))

    def _deliver_loop(self) -> None:
        while True:
            item = self._deliveries.get()
            if item is None:
                return
            stream, output = item
            if not stream.put(output):  # its consumer is gone
                self._detach(stream)

    def _finalize_locked(self, rid: str, output: DiffusionOutput) -> None:
        """The one place a request becomes terminal: exactly one final output."""
        rec = self._records.pop(rid, None)
        if rec is None:
            return
        rec.metrics.forward_time = rec.forward_time if rec.forward_time > 0 else None
        rec.metrics.finished_time = self._clock()
        output.metrics = rec.metrics
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._deliveries.put((stream, output))

    def _fail_all_locked(self, reason: str) -> None:
        self._scheduler.fail_all(reason)
        for rid, rec in list(self._records.items()):
            if rec.output_id is not None:
                self._executor.release_output(rec.output_id)
            self._finalize_locked(rid, DiffusionOutput(
                rid, finished=True, error=reason, step=rec.step, total_steps=rec.total_steps))

    def _die(self, reason: str) -> None:
        logger.error("engine is unhealthy: %s", reason)
        with self._cond:
            if self._dead_reason is None and not self._closed:
                self._dead_reason = reason
            self._fail_all_locked(reason)
            self._cond.notify_all()


def _convert(meta: Any, cls: type) -> Any:
    return meta if isinstance(meta, cls) else msgspec.convert(meta, cls)


def _release_quietly(future: concurrent.futures.Future) -> None:
    try:
        future.result(timeout=0).release()
    except Exception:
        pass


def executor_config(config: EngineConfig) -> ExecutorConfig:
    """The runtime settings an engine config implies."""
    from diffrt.platforms import current_platform

    kw: dict[str, Any] = dict(config.executor_options)
    if config.output_timeout_s is not None:
        kw["output_timeout_s"] = config.output_timeout_s
    if config.max_pending_output_bytes is not None:
        kw["max_pending_output_bytes"] = config.max_pending_output_bytes
    async_output = config.async_output
    if async_output is None:
        async_output = bool(current_platform.supports_async_output)
    runner_kwargs: dict[str, Any] = {"model": config.model, "dtype": config.dtype}
    if config.torch_threads is not None:
        runner_kwargs["torch_threads"] = config.torch_threads
    runner_kwargs.update(kw.pop("runner_kwargs", {}))
    return ExecutorConfig(runner_cls=RUNNER_CLS, runner_kwargs=runner_kwargs,
                          world_size=config.world_size, async_output=async_output, **kw)
