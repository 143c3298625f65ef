"""DiffusionEngine: the public API over an engine core and an output processor.

Follow one request:

1. ``generate`` / ``step_streaming`` check it here against the model's
   ``ModelSpec`` (``submission.py``; duplicate ids too), create its ``RequestRecord``, open its stream in the
   ``OutputProcessor`` and queue it in the ``EngineCore``.
2. The core's loop (``core.py``) schedules a tick, sends it to the workers as
   one typed request (``runner_messages.py``), where ``PipelineRunner``
   (``pipeline_runner.py``) runs the pipeline, and reports a ``TickResult``
   at COMPUTE_DONE.
3. The output processor (``output_processor.py``) emits progress at once and,
   when a finished request's output has landed in host memory, post-processes
   it on a small pool and emits the final output on the stream.

With ``restart_workers``, a request submitted while fresh workers start is
queued for them and its submitter waits (``holds.py``): served once
they are, refused with ``EngineRestartingError`` past ``restart_wait_s`` (or
its own timeout), ``EngineDeadError`` when the restart gives up.

The core never waits for an output and the output processor never calls the
workers, so a slow copy or PIL conversion never delays the next tick. The
engine's parts are built in their own modules: the scheduler and memory
model (``assembly.py``), the workers and the fresh ones of a restart
(``workers.py``), the warm-up and calibration (``start_up.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import overload

from diffrt.engine.assembly import (
    cost_stats,
    make_scheduler,
    memory_model,
    run_time_model,
    save_step_costs,
)
from diffrt.engine.config import EngineConfig
from diffrt.engine.core import EngineCore
from diffrt.engine.errors import (
    DeadlineUnmeetableError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRestartingError,
    EngineWarmupError,
)
from diffrt.engine.holds import Hold, RestartHolds
from diffrt.engine.input_images import release
from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.output_processor import OutputProcessor
from diffrt.engine.output_streams import FinalSlot, OutputStream, resolve
from diffrt.engine.outputs import DiffusionOutput, RequestMetrics
from diffrt.engine.postprocess import output_postprocessor
from diffrt.engine.record import RequestRecord
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.rollout_control import RolloutControl
from diffrt.engine.runner_messages import WeightBytes
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.sched import Scheduler
from diffrt.engine.seats import Seat
from diffrt.engine.start_up import warm_up
from diffrt.engine.stats import EngineStats
from diffrt.engine.submission import accept, check, timeout_of
from diffrt.engine.workers import FreshWorkers, count_weights, start_executor
from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)

#: How long close() lets the current tick finish before shutting the executor.
CLOSE_GRACE_S = 5.0

__all__ = ["DiffusionEngine", "EngineClosedError", "EngineDeadError", "EngineError",
           "EngineRestartingError", "EngineWarmupError"]


class DiffusionEngine(RolloutControl):
    """Serves one model; see the module docstring for the request path (weight
    updates, sleep and wake: ``rollout_control.py``)."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        scheduler: Scheduler | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.mode = config.mode
        #: what the served model accepts (submission checks, batch keys, post-processing)
        self.spec = config.model_spec()
        #: requests' input images, by handle (``runtime.input_arena``); kept
        #: across worker restarts (None: the executor carries no inputs)
        self.inputs = executor.inputs.retain() if executor.inputs is not None else None
        self._clock = clock
        #: the LoRA adapters registered, their requests and device slots
        self.adapters = AdapterRegistry(config.model_config.max_loras,
                                        accepts_adapters=bool(self.spec.lora_target_modules),
                                        model=self.spec.name)
        try:
            #: the warm workers a restart swaps in (``workers.py``)
            self._fresh_executor = FreshWorkers(config, self.spec, self.adapters, self.inputs)
        except BaseException:
            if self.inputs is not None:
                self.inputs.close()  # the executor's own hold closes with it
            raise
        #: the step-cost model: what steps and requests cost (``run_time.py``);
        #: persisted under ``cost_key`` (``cost_store``)
        self.run_time, self.cost_key = run_time_model(config, self.spec)
        #: True while the start-up requests run: they are the engine's own and
        #: are never refused by max_request_seconds (on a busy machine the
        #: calibration's second request was estimated past a small limit, and
        #: the engine could not start)
        self.starting = False
        #: a request's estimated peak memory and the batch budget (None: unbounded)
        self.memory = memory_model(config, self.spec)
        if scheduler is not None and getattr(scheduler, "adapters", False) is None:
            scheduler.adapters = self.adapters
        self.output_processor = OutputProcessor(
            output_postprocessor(self.spec),
            workers=config.executor.postprocess_workers,
            unread_output_timeout_s=config.limits.unread_output_timeout_s, clock=clock,
            on_end=self._free_inputs)
        self._core = EngineCore(
            self.mode, scheduler or make_scheduler(config, self.spec, self.run_time,
                                                   self.memory, self.adapters),
            executor, on_tick=self.output_processor.on_tick, on_dead=self._on_dead,
            clock=clock,
            restart=self._fresh_executor if config.executor.restart_workers else None,
            on_timer=self.output_processor.expire_unread, run_time=self.run_time,
            memory=self.memory, adapters=self.adapters,
            refuse_unmeetable=config.scheduling.refuse_unmeetable)
        #: submissions made while fresh workers start wait here (``holds.py``)
        self._holds = RestartHolds(config, self._core, self.output_processor, clock)
        self._closed = False
        self._close_lock = threading.Lock()
        self._core.start()

    @classmethod
    def make_engine(cls, config: EngineConfig, *, scheduler: Scheduler | None = None,
                    executor: Executor | None = None) -> DiffusionEngine:
        """Build executor and scheduler, warm up within
        ``config.warmup_timeout_s``; on any failure everything started so far is
        shut down before the error propagates."""
        if executor is None:
            executor = start_executor(config)  # after the dry run of the workers' set-up
        try:
            engine = cls(config, executor, scheduler)
        except BaseException:
            executor.shutdown()
            raise
        try:
            engine.weight_bytes = count_weights(engine.executor, config, engine.spec)
            for name, path in config.model_config.lora_modules.items():
                engine.add_lora(name, path)
        except BaseException:
            engine._shutdown(grace_s=0.0)
            raise
        if config.model_config.warmup:
            engine.starting = True
            try:
                warm_up(engine)
            except BaseException as exc:
                engine._shutdown(grace_s=0.0)  # a hung warm-up tick is not waited for
                if isinstance(exc, EngineWarmupError):
                    raise
                raise EngineWarmupError(f"warm-up failed: {exc}") from exc
            finally:
                engine.starting = False
        logger.info("engine ready: model=%s mode=%s max_num_seqs=%d executor=%s",
                    config.model_config.model, engine.mode.value,
                    config.scheduling.max_num_seqs, config.executor.executor_backend)
        return engine

    #: what the loaded weights hold, per component and device (``CountWeights``
    #: at start; None until then, or with an executor that loads nothing)
    weight_bytes: WeightBytes | None = None

    def _free_inputs(self, record: RequestRecord) -> None:
        """A request ended (or never ran): its input images' slots are free."""
        release(record.request, self.inputs)

    # -- public API -------------------------------------------------------------------
    @overload
    def generate(self, requests: DiffusionRequest, *,
                 timeout: float | None = None) -> DiffusionOutput: ...

    @overload
    def generate(self, requests: Sequence[DiffusionRequest], *,
                 timeout: float | None = None) -> list[DiffusionOutput]: ...

    def generate(self, requests: DiffusionRequest | Sequence[DiffusionRequest], *,
                 timeout: float | None = None) -> DiffusionOutput | list[DiffusionOutput]:
        """Run requests to completion; one output, or a list in the same order.

        Raises InvalidRequestError (nothing submitted) for a bad request, and
        TimeoutError after ``timeout`` seconds (the unfinished requests are
        aborted). Outputs are taken as they finish, whatever the order. While
        fresh workers start (``restart_workers``) the call waits for them;
        past ``restart_wait_s`` it raises EngineRestartingError, and
        EngineDeadError when the restart gives up (nothing submitted).
        """
        single = isinstance(requests, DiffusionRequest)
        if isinstance(requests, DiffusionRequest):
            batch = [requests]
        elif isinstance(requests, (list, tuple)):
            batch = list(requests)
        else:  # a dict is not a batch (its keys would be taken for requests)
            raise InvalidRequestError("request", "must be a DiffusionRequest or a list of "
                                      f"them, got {type(requests).__name__}")
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        give_up_at = None if timeout is None else time.monotonic() + timeout
        streams, hold = self._submit(batch, loop=None, inbox=inbox)
        finals: dict[str, DiffusionOutput] = {}
        try:
            if hold is not None:  # fresh workers are starting: wait for them here
                self._holds.wait(hold, give_up_at, timeout)
            while len(finals) < len(streams):
                remaining = None if give_up_at is None else give_up_at - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{len(streams) - len(finals)} request(s) did not "
                                       f"finish within {timeout} s")
                try:
                    rid, item = inbox.get(timeout=remaining)
                except queue.Empty:
                    continue
                if isinstance(item, FinalSlot) or item.finished:
                    finals[rid] = resolve(item)
        except BaseException:
            for stream in streams:
                if stream.request_id not in finals:
                    self.output_processor.detach(stream)
                    self.abort(stream.request_id)
            raise
        outputs = [finals[stream.request_id] for stream in streams]
        return outputs[0] if single else outputs

    async def step_streaming(self, request: DiffusionRequest, *, seat: Seat | None = None
                             ) -> AsyncGenerator[DiffusionOutput, None]:
        """Yield the request's progress outputs, then its final output.

        Leaving early (break, cancellation) detaches this consumer only: the
        request still runs to its end and is cleaned up (an unread output is
        freed at once); use ``abort`` to stop it. While fresh workers start,
        the first item waits for them without blocking the event loop, and
        raises as ``generate`` does when they do not come. ``seat``
        (``take_seat``) moves into the waiting queue with the request when it
        is submitted (on the first item); a seat whose request never got there
        is the caller's to ``release``.
        """
        [stream], hold = self._submit([request], loop=asyncio.get_running_loop(), seat=seat)
        finished = False
        try:
            if hold is not None:
                await self._holds.wait_async(hold)
            while not finished:
                item = await stream.aget()
                if isinstance(item, FinalSlot):  # post-processed off the event loop
                    out = await asyncio.wrap_future(self.output_processor.take_async(item))
                else:
                    out = item
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.output_processor.detach(stream)

    async def generate_async(self, request: DiffusionRequest) -> DiffusionOutput:
        """The final output of ``step_streaming`` (for asyncio callers)."""
        final = None
        async for out in self.step_streaming(request):
            final = out
        assert final is not None
        return final

    def check(self, request: DiffusionRequest) -> None:
        """Refuse ``request`` as its submission would (``InvalidRequestError``
        naming the field: its fields, the model's limits, the run-time limit
        on the current estimate, its adapters), submitting nothing. A server
        asks before it creates what outlives the call (a video job); the
        submission checks again (an estimate may move in between)."""
        checked = check(request, self.spec, self.config,
                        None if self.starting else self.run_time)
        self.adapters.check(checked.sampling_params.loras)

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request at the next step boundary and free
        its outputs. An unknown or finished id does nothing. One call into the
        core; its outcome reaches the output processor as the core's report."""
        record = self.output_processor.active_record(request_id)
        if record is not None:  # else unknown or finished: nothing to stop
            self._core.abort(request_id, None, record)
            self._core.restart_gate.wake()  # a submitter held for a restart returns

    def take_seat(self, limit: int, *, on_admitted: Callable[[], None] | None = None) -> Seat:
        """A place among the waiting requests for one about to be submitted,
        taken at once under the core's lock; refused (``seat.taken`` False)
        when ``limit`` wait already, counting the seats not yet submitted
        (``seats.py``: how a server sheds without a race). ``on_admitted`` is
        called on the engine loop's thread, with no lock held, when the
        request joins the running set; it must be quick and must not call
        into the engine."""
        return self._core.take_seat(limit, on_admitted)

    def is_healthy(self) -> bool:
        return not self._closed and self._core.is_alive() and self.executor.is_healthy()

    def is_restarting(self) -> bool:
        """Fresh workers are starting after the old ones died or hung
        (``restart_workers``): a request submitted now waits for them, up to
        ``restart_wait_s``. ``is_healthy()`` is False meanwhile."""
        return not self._closed and self._core.is_restarting()

    def stall(self, idle_s: float | None = None) -> str | None:
        """Why the engine counts as stalled now, or None: the execute call in
        flight has gone without a sign of progress (a reply, an output, a
        heartbeat) for longer than ``stall_timeout_s`` — a hung or stopped
        worker, or a step or compile that long. Progress clears it. It only
        reports (a server's /health says so within seconds); the workers are
        killed at ``execute_timeout_s``. ``idle_s``: the executor's
        ``seconds_without_progress()`` if the caller read it already."""
        limit = self.config.executor.stall_timeout_s
        idle = self.executor.seconds_without_progress() if idle_s is None else idle_s
        if limit is None or idle <= limit:
            return None
        return f"no progress for {idle:.0f} s (stall_timeout_s={limit:g})"

    def save_costs(self) -> None:
        """Persist the step-cost model (``cost_store``; never raises)."""
        save_step_costs(self.run_time, self.cost_key, self.spec.name)

    def close(self) -> None:
        """Refuse new work, send an error output to every open stream, stop the
        executor (idempotent)."""
        self._shutdown(CLOSE_GRACE_S)

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def executor(self) -> Executor:
        return self._core.executor

    @property
    def scheduler(self) -> Scheduler:
        return self._core.scheduler

    def num_active_requests(self) -> int:
        return self.output_processor.num_active()

    def stats(self) -> EngineStats:
        """Queue gauges now, plus counters and histograms since start (``stats.py``)."""
        waiting, running = self._core.queue_sizes()
        idle = self.executor.seconds_without_progress()
        snapshot = self.output_processor.stats.snapshot(
            waiting=waiting, running=running,
            pending_output_bytes=self.output_processor.unread_bytes(),
            healthy=self.is_healthy(), worker_restarts=self._core.restarts,
            seconds_without_progress=idle, stall=self.stall(idle),
            loras=self.adapters.snapshot(), lora_requests=self.adapters.requests_by_name(),
            paused=self._core.paused())
        return dataclasses.replace(snapshot, sleeping=self.sleeping,
                                   **cost_stats(self.run_time, self.scheduler))

    # -- internals ---------------------------------------------------------------------
    def _submit(self, requests: list[DiffusionRequest], loop: asyncio.AbstractEventLoop | None,
                inbox: queue.SimpleQueue | None = None,
                seat: Seat | None = None) -> tuple[list[OutputStream], Hold | None]:
        """Check, register and queue ``requests`` (all or none); their streams,
        and the hold its caller is to wait out when fresh workers are starting
        (``RestartHolds.wait`` or ``wait_async``)."""
        records: list[RequestRecord] = []
        seen: set[str] = set()
        now = self._clock()
        try:
            for request in requests:
                request = accept(request, self.spec, self.config,
                                 None if self.starting else self.run_time, self.inputs)
                record = RequestRecord(request, arrival=now,
                                       metrics=RequestMetrics(arrival_time=now))
                records.append(record)  # its inputs are stored: freed below if refused
                self.adapters.check(request.sampling_params.loras)
                if request.request_id in seen:
                    raise InvalidRequestError("request_id", f"{request.request_id!r} given twice")
                seen.add(request.request_id)
                record.timeout_at, record.timeout_reason = timeout_of(request, now, self.config)
                record.seat = seat  # step_streaming: one request
            streams = self.output_processor.add(records, loop, inbox)  # refuses once closed or dead
        except BaseException:  # none was registered: the accepted ones' inputs go now
            for record in records:
                release(record.request, self.inputs)
            raise
        restarting = self._core.is_restarting()  # queued for the fresh workers
        if not restarting and not self.executor.is_healthy():
            self.output_processor.discard(records)
            raise EngineDeadError("engine is not healthy: executor is down")
        for record in records:  # until the hold ends, it answers for them
            record.held = restarting
        try:
            queued = self._core.add(records)
        except BaseException as exc:
            self.output_processor.discard(records)
            if isinstance(exc, DeadlineUnmeetableError):
                for record in records:
                    self.output_processor.stats.on_refused(record.request.sampling_params.priority)
            raise
        if not queued:
            self.output_processor.discard(records)
            if self._core.dead_reason is not None:
                raise EngineDeadError(f"engine is not healthy: {self._core.dead_reason}")
            raise EngineClosedError("engine is closed")
        return streams, (self._holds.hold_for(records, now) if restarting else None)

    def _on_dead(self, reason: str) -> None:
        self.output_processor.fail_all(reason, dead=True)

    def _shutdown(self, grace_s: float) -> None:
        """close(), letting a tick in flight finish for up to ``grace_s``."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # Streams hear at once; a tick still in flight finds its requests gone
        # and frees whatever it produced.
        self.output_processor.fail_all("engine closed", dead=False)
        self._core.stop(grace_s)
        self.save_costs()
        self.output_processor.close()
        self.remove_update_files()
        if self.inputs is not None:
            self._fresh_executor.close()
            self.inputs.close()
        logger.info("engine closed")
