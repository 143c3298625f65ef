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
queued for them and its submitter waits (``restart_gate.py``): served once
they are, refused with ``EngineRestartingError`` past ``restart_wait_s`` (or
its own timeout), ``EngineDeadError`` when the restart gives up.

The core never waits for an output and the output processor never calls the
workers, so a slow copy or PIL conversion never delays the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import overload

from diffrt.engine.config import EngineConfig, EngineConfigError, EngineMode, usable_methods
from diffrt.engine.core import EngineCore, restart_worst_case_s
from diffrt.engine.errors import (
    DeadlineUnmeetableError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRestartingError,
    EngineWarmupError,
)
from diffrt.engine.input_images import release
from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.lora.registration import load_on_workers
from diffrt.engine.lora.registry import AdapterRegistry, LoraInfo
from diffrt.engine.memory_estimate import (
    DEFAULT_DEVICE_SHARE,
    DEFAULT_HOST_SHARE,
    MemoryModel,
    default_batch_memory_budget,
    value_bytes,
)
from diffrt.engine.output_processor import OutputProcessor
from diffrt.engine.output_streams import FinalSlot, OutputStream, resolve
from diffrt.engine.outputs import DiffusionOutput, RequestMetrics
from diffrt.engine.pipelines.segments import resolve_mixed_rows
from diffrt.engine.postprocess import output_postprocessor
from diffrt.engine.record import RequestRecord
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.runner_messages import CountWeights, DropLora, ExecuteBatch, WeightBytes
from diffrt.engine.sampling import InvalidRequestError, SamplingParams
from diffrt.engine.sched import (
    RequestScheduler,
    Scheduler,
    StepScheduler,
    make_policy,
)
from diffrt.engine.seats import Seat
from diffrt.engine.stats import EngineStats
from diffrt.engine.submission import accept, timeout_of
from diffrt.engine.token_budget import derived_token_budget
from diffrt.engine.weights.budget import refusal, weight_settings
from diffrt.runtime.executor import Executor
from diffrt.runtime.factory import make_executor

logger = logging.getLogger(__name__)

#: How long close() lets the current tick finish before shutting the executor.
CLOSE_GRACE_S = 5.0
#: What stopping a set of workers may add to shutdown_grace_s (the pump's join,
#: then SIGTERM and SIGKILL in the multiprocess executor: 5 + 2 + 5 s), for
#: the worst case of a restart (``restart_wait_s=None``).
WORKER_STOP_SLACK_S = 12.0

__all__ = ["DiffusionEngine", "EngineClosedError", "EngineDeadError", "EngineError",
           "EngineRestartingError", "EngineWarmupError"]


@dataclass
class _Hold:
    """A submission made while fresh workers start: its records are queued
    for them, and its submitter waits until ``until`` (the engine's clock)."""

    records: list[RequestRecord]
    since: float
    until: float
    #: what set ``until``, for the error past it
    bound: str

    def release(self) -> None:
        """The wait is over: the core's timer may end the records again."""
        for record in self.records:
            record.held = False


#: the second calibration request has at least this many times the first's work
CALIBRATION_WORK_RATIO = 2.0


class DiffusionEngine:
    """Serves one model; see the module docstring for the request path."""

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
        #: the warm-up a restart's fresh workers run, accepted once now: an
        #: edit-only model's start-up picture then stays stored for the engine's
        #: life, so a restart finds it even when queued requests fill the arena
        self._restart_warmup: DiffusionRequest | None = None
        if config.executor.restart_workers and self.inputs is not None:
            try:
                self._restart_warmup = accept(self._warmup_request(), self.spec, config, None,
                                              self.inputs)
            except BaseException:
                self.inputs.close()  # the executor's own hold closes with it
                raise
        self._clock = clock
        #: the estimate of a request's seconds that max_request_seconds refuses by
        self.run_time = RunTimeModel(self.spec)
        #: a request's estimated peak memory and the batch budget (None: unbounded)
        self.memory = self._memory_model()
        #: the LoRA adapters registered, their requests and device slots
        self.adapters = AdapterRegistry(config.model_config.max_loras,
                                        accepts_adapters=bool(self.spec.lora_target_modules),
                                        model=self.spec.name)
        if scheduler is not None and getattr(scheduler, "adapters", False) is None:
            scheduler.adapters = self.adapters  # type: ignore[attr-defined]
        self.output_processor = OutputProcessor(
            output_postprocessor(self.spec),
            workers=config.executor.postprocess_workers,
            unread_output_timeout_s=config.limits.unread_output_timeout_s, clock=clock,
            on_end=self._free_inputs)
        self._core = EngineCore(
            self.mode, scheduler or self._make_scheduler(), executor,
            on_tick=self.output_processor.on_tick, on_dead=self._on_dead, clock=clock,
            restart=self._fresh_executor if config.executor.restart_workers else None,
            on_timer=self.output_processor.expire_unread, run_time=self.run_time,
            memory=self.memory, adapters=self.adapters,
            reject_unmeetable=config.scheduling.reject_unmeetable)
        #: how long a submission during a restart waits for it, and why that long
        self._restart_wait_s, self._restart_wait_bound = _restart_wait(config)
        self._closed = False
        self._close_lock = threading.Lock()
        self._core.start()

    @classmethod
    def make_engine(cls, config: EngineConfig, *, scheduler: Scheduler | None = None,
                    executor: Executor | None = None) -> DiffusionEngine:
        """Build executor and scheduler, warm up within
        ``config.warmup_timeout_s``; on any failure everything started so far is
        shut down before the error propagates."""
        from diffrt.platforms import current_platform

        if executor is None:
            executor = make_executor(config.executor.executor_backend, config.executor_config(
                platform=current_platform))
        try:
            engine = cls(config, executor, scheduler)
        except BaseException:
            executor.shutdown()
            raise
        try:
            engine._count_weights()
            for name, path in config.model_config.lora_modules.items():
                engine.add_lora(name, path)
        except BaseException:
            engine._shutdown(grace_s=0.0)
            raise
        if config.model_config.warmup:
            try:
                engine._warmup()
            except BaseException as exc:
                engine._shutdown(grace_s=0.0)  # a hung warm-up tick is not waited for
                if isinstance(exc, EngineWarmupError):
                    raise
                raise EngineWarmupError(f"warm-up failed: {exc}") from exc
        logger.info("engine ready: model=%s mode=%s max_num_seqs=%d executor=%s",
                    config.model_config.model, engine.mode.value,
                    config.scheduling.max_num_seqs, config.executor.executor_backend)
        return engine

    #: what the loaded weights hold, per component and device (``CountWeights``
    #: at start; None until then, or with an executor that loads nothing)
    weight_bytes: WeightBytes | None = None

    def _count_weights(self) -> None:
        """What the loaded weights hold (``weight_bytes``), logged; past
        ``device_memory_budget`` the start fails naming what would fit."""
        replies = self.executor.collective_rpc(CountWeights())
        report = next((r for r in replies if isinstance(r, WeightBytes)), None)
        if report is None:
            return  # an executor of a test's own that loads nothing
        self.weight_bytes = report
        logger.info("resident weights: %s", ", ".join(
            f"{name} ({report.methods.get(name, 'none')}) "
            + " + ".join(f"{n / 2**20:.1f} MiB {kind}" for kind, n in sorted(held.items()))
            for name, held in report.components.items()))
        logger.info("weights on the device at their peak: %.1f MiB%s", report.on_device / 2**20,
                    "".join(f"; {name} offloaded ({n / 2**20:.1f} MiB in host memory)"
                            for name, n in report.offloaded.items()))
        from diffrt.platforms import current_platform

        model = self.config.model_config
        budget, on_device = model.device_memory_budget, report.on_device
        if budget is not None and on_device > budget:
            raise EngineConfigError("device_memory_budget", refusal(
                on_device, budget, self.spec.folder, value_bytes(model.dtype, current_platform),
                current=weight_settings(model), methods=usable_methods(self.spec, current_platform),
                host_is_device=current_platform.host_is_device, measured=True))

    def _make_scheduler(self) -> Scheduler:
        from diffrt.platforms import current_platform

        c = self.config.scheduling
        policy = make_policy(c.scheduling_policy, max_bypass=c.scheduling_max_bypass,
                             aging_ticks=c.slo_aging_ticks, cost=self.run_time)
        if self.mode is EngineMode.STEP_BATCH:
            return StepScheduler(c.max_num_seqs, policy,
                                 max_wait_s=_seconds(c.step_batch_max_wait_ms),
                                 key=self._step_batch_key(),
                                 max_steps_per_tick=c.max_steps_per_tick, memory=self.memory,
                                 tokens=lambda r: (self.spec.rows(r), self.spec.row_tokens(r)),
                                 token_budget=c.max_num_batched_tokens or None,
                                 padded=resolve_mixed_rows(self.config.model_config.mixed_rows,
                                                           current_platform) == "padded",
                                 adapters=self.adapters,
                                 max_paused_bytes=c.max_paused_state_bytes)
        wait_ms = c.request_batch_max_wait_ms if self.spec.supports_request_batch else 0.0
        return RequestScheduler(c.max_num_seqs, policy, max_wait_s=_seconds(wait_ms),
                                key=self.spec.request_batch_key, memory=self.memory,
                                adapters=self.adapters)

    def _step_batch_key(self) -> Callable[[DiffusionRequest], tuple]:
        """Sizes share a step when the setting, the model and the split allow
        (``mixed_size_batching``; a sequence-parallel split shards one size's
        tokens, so there the size stays in the key)."""
        spec = self.spec
        if not (self.config.scheduling.mixed_size_batching and spec.mixed_sizes):
            return spec.step_batch_key
        p = self.config.parallel
        if p.ulysses_degree * p.ring_degree > 1:
            logger.info("mixed_size_batching: off with ulysses_degree=%d ring_degree=%d "
                        "(a sequence split needs one size per step)",
                        p.ulysses_degree, p.ring_degree)
            return spec.step_batch_key
        return spec.mixed_step_batch_key

    def _memory_model(self) -> MemoryModel | None:
        """A request's estimated peak memory and the batch budget
        (``max_batch_memory_bytes``, or a share of the memory the workers
        report free; see ``engine/memory_estimate.py``); None with one request
        per batch: nothing to bound."""
        from diffrt.platforms import current_platform

        if self.config.scheduling.max_num_seqs == 1:
            return None
        budget = self.config.scheduling.max_batch_memory_bytes
        on_cpu = current_platform.device_type == "cpu"
        model = MemoryModel(
            self.spec, value_bytes(self.config.model_config.dtype, current_platform),
            budget=budget if budget is not None else default_batch_memory_budget(current_platform),
            explicit=budget is not None,
            share=DEFAULT_HOST_SHARE if on_cpu else DEFAULT_DEVICE_SHARE)
        if model.budget is not None:
            logger.info("batch memory budget %d MiB of estimated peak activations",
                        model.budget >> 20)
        return model

    def _warmup_request(self) -> DiffusionRequest:
        """A one-step request of about 64 px: loads kernels, allocates buffers."""
        size = self.spec.warmup_size()
        return DiffusionRequest(
            prompt="warm-up", request_id=f"warmup-{uuid.uuid4().hex[:8]}",
            images=self._start_up_images(size),
            sampling_params=SamplingParams(height=size, width=size, num_inference_steps=1,
                                           seed=0, guidance_scale=1.0))

    def _start_up_images(self, side: int) -> list:
        """A start-up request's input: none, or a plain picture for a model
        that only edits (Qwen-Image-Edit draws nothing from text alone)."""
        if "text-to-image" in self.spec.tasks:
            return []
        from PIL import Image

        return [Image.new("RGB", (side, side), (128, 128, 128))]

    def _free_inputs(self, record: RequestRecord) -> None:
        """A request ended (or never ran): its input images' slots are free."""
        release(record.request, self.inputs)

    def _fresh_executor(self) -> Executor:
        """New workers for a restart, warmed up by one request run on them
        directly (its output is dropped); the core swaps them in."""
        from diffrt.platforms import current_platform

        executor = make_executor(self.config.executor.executor_backend, self.config.executor_config(
            platform=current_platform), self.inputs)
        try:
            warmup = self._restart_warmup or accept(self._warmup_request(), self.spec,
                                                    self.config, None, self.inputs)
            try:
                out = executor.execute(ExecuteBatch(requests=[warmup]),
                                       timeout=self.config.model_config.warmup_timeout_s)
            finally:
                if warmup is not self._restart_warmup:
                    release(warmup, self.inputs)
            for oid in out.output_ids.values():
                executor.release_output(oid)
            self._reload_adapters(executor)
        except BaseException:
            executor.shutdown()
            raise
        return executor

    def _reload_adapters(self, executor: Executor) -> None:
        """Fresh workers read every registered adapter again; one whose file
        cannot be read now is dropped from the registry (logged), not a
        reason to stay down."""
        for adapter in self.adapters.registered():
            try:
                load_on_workers(executor, adapter.id, adapter.path,
                                self.config.model_config.lora_load_timeout_s)
            except (AdapterFileError, TimeoutError) as exc:
                logger.error("LoRA adapter %r is gone after the restart: %s", adapter.name, exc)
                self.adapters.lost(adapter.id)

    def _run_start_up_request(self, request: DiffusionRequest) -> None:
        try:
            out = self.generate(request, timeout=self.config.model_config.warmup_timeout_s)
        except TimeoutError:
            raise EngineWarmupError(
                "warm-up did not finish within "
                f"warmup_timeout_s={self.config.model_config.warmup_timeout_s}"
            ) from None
        if not out.ok:
            raise EngineWarmupError(f"warm-up request failed: {out.error}")

    def _calibration_requests(self) -> list[DiffusionRequest]:
        """The run-time estimate's first measurements, on warm kernels, at two
        sizes far enough apart in work to tell a step's overhead from its
        per-unit cost (``run_time.MIN_SPREAD``): the warm-up's side, and the
        smallest side (within the model's limits) with at least ``CALIBRATION_WORK_RATIO`` times its work — text tokens dominate
        a small image's row, so twice the side is not always enough. Each
        runs two worker calls' worth of steps (so prompt encoding and the
        decode weigh on few of them), with a prompt of its own (the prompt
        cache would spare the second its encoding)."""
        spec, multiple = self.spec, self.spec.size_multiple
        largest = spec.max_size // multiple * multiple

        def request(i: int, side: int) -> DiffusionRequest:
            return DiffusionRequest(
                prompt=f"calibration {i}", request_id=f"calibrate-{uuid.uuid4().hex[:8]}",
                images=self._start_up_images(side),
                sampling_params=SamplingParams(
                    height=side, width=side, seed=0, guidance_scale=1.0,
                    num_inference_steps=2 * self.config.scheduling.max_steps_per_tick))

        first = request(0, spec.warmup_size())
        side, work = spec.warmup_size(), self.run_time.units(spec.with_defaults(first))
        while side + multiple <= largest:
            side += multiple
            if self.run_time.units(spec.with_defaults(request(1, side))) >= (
                    CALIBRATION_WORK_RATIO * work):
                break
        return [first] if side == spec.warmup_size() else [first, request(1, side)]

    def _warmup(self) -> None:
        """The warm-up request (cold: loads kernels, allocates buffers), then the
        calibration requests whose measured steps are the run-time estimate's
        first (and, in STEP_BATCH, what the default token budget is derived from)."""
        start = time.monotonic()
        self._run_start_up_request(self._warmup_request())
        self.run_time.reset()  # a cold tick is no measure of a warm one
        calibration = self._calibration_requests()
        for request in calibration:
            self._run_start_up_request(request)
        self.output_processor.stats.reset()  # stats() describes served requests only
        self.scheduler.forget_run_times()  # a cold one-step request sizes no window
        scheduler = self.scheduler
        if (isinstance(scheduler, StepScheduler)
                and self.config.scheduling.max_num_batched_tokens is None):
            smallest = self.run_time.units(self.spec.with_defaults(calibration[0]))
            scheduler.token_budget = derived_token_budget(self.run_time.coefficients, smallest)
            logger.info("max_num_batched_tokens: %s (derived from the warm-up's step times)",
                        scheduler.token_budget or "no bound")
        logger.info("warm-up done in %.2f s", time.monotonic() - start)

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
                self._hold(hold, give_up_at, timeout)
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
                await self._hold_async(hold)
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

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request at the next step boundary and free
        its outputs. An unknown or finished id does nothing. One call into the
        core; its outcome reaches the output processor as the core's report."""
        record = self.output_processor.active_record(request_id)
        if record is not None:  # else unknown or finished: nothing to stop
            self._core.abort(request_id, None, record)
            self._core.restart_gate.wake()  # a submitter held for a restart returns

    # -- LoRA adapters ---------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Register the adapter file (or folder) ``path`` as ``name``; every
        worker reads it on its loader thread while requests keep running, and
        this call returns once they all have it. ``LoraExistsError`` for a
        name registered already, ``AdapterFileError`` naming the file and why
        it is not an adapter this model can serve (the engine serves on)."""
        adapter = self.adapters.reserve(name, os.path.abspath(path))
        timeout = self.config.model_config.lora_load_timeout_s
        executor = self.executor
        try:
            state = load_on_workers(executor, adapter.id, adapter.path, timeout)
        except BaseException:
            self.adapters.abandon(adapter)
            raise
        adapter.rank, adapter.modules, adapter.nbytes = state.rank, state.modules, state.nbytes
        self.adapters.confirm(adapter)
        if self.executor is not executor:  # fresh workers started meanwhile: they read it too
            try:
                load_on_workers(self.executor, adapter.id, adapter.path, timeout)
            except Exception as exc:
                self.adapters.lost(adapter.id)
                raise AdapterFileError(f"{adapter.path}: the restarted workers could not read "
                                       f"it: {exc}") from exc
        logger.info("LoRA adapter %r registered: %s (rank %d, %d layers, %d KiB)", name,
                    adapter.path, state.rank, state.modules, state.nbytes >> 10)
        return next(info for info in self.adapters.infos() if info.name == name)

    def remove_lora(self, name: str) -> None:
        """Refuse ``name`` in new requests (``KeyError`` when not registered);
        the requests accepted with it are served, and its weights leave the
        workers when the last of them ends."""
        ids = self.adapters.remove(name)
        logger.info("LoRA adapter %r removed", name)
        if ids:
            try:
                self.executor.collective_rpc(DropLora(ids))
            except Exception as exc:  # removed all the same: workers gone hold nothing
                logger.warning("dropping LoRA adapter %r in the workers failed: %s", name, exc)

    def list_loras(self) -> list[LoraInfo]:
        """The registered adapters, by name."""
        return self.adapters.infos()

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
        return self.output_processor.stats.snapshot(
            waiting=waiting, running=running,
            pending_output_bytes=self.output_processor.unread_bytes(),
            healthy=self.is_healthy(), worker_restarts=self._core.restarts,
            seconds_without_progress=idle, stall=self.stall(idle),
            loras=self.adapters.snapshot(), lora_requests=self.adapters.requests_by_name(),
            paused=self._core.paused())

    # -- internals ---------------------------------------------------------------------
    def _submit(self, requests: list[DiffusionRequest], loop: asyncio.AbstractEventLoop | None,
                inbox: queue.SimpleQueue | None = None,
                seat: Seat | None = None) -> tuple[list[OutputStream], _Hold | None]:
        """Check, register and queue ``requests`` (all or none); their streams,
        and the hold its caller is to wait out when fresh workers are starting
        (``_hold`` or ``RestartGate.wait_async``, then ``_end_hold``)."""
        records: list[RequestRecord] = []
        seen: set[str] = set()
        now = self._clock()
        try:
            for request in requests:
                request = accept(request, self.spec, self.config, self.run_time, self.inputs)
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
        return streams, (self._hold_for(records, now) if restarting else None)

    # -- submissions during a restart ----------------------------------------------------
    def _hold_for(self, records: list[RequestRecord], now: float) -> _Hold:
        """How long records submitted at ``now`` wait for fresh workers: the
        restart wait, or the first of their own timeouts when that comes sooner."""
        until, bound = now + self._restart_wait_s, self._restart_wait_bound
        for record in records:
            if record.timeout_at is not None and record.timeout_at < until:
                until, bound = record.timeout_at, "its timeout"
        return _Hold(records, now, until, bound)

    def _held(self, hold: _Hold) -> bool:
        """Fresh workers are still starting and some of the records still waits."""
        return self._core.is_restarting() and self._core.any_waiting(hold.records)

    def _hold(self, hold: _Hold, give_up_at: float | None, timeout: float | None) -> None:
        """``generate``'s wait for fresh workers (the calling thread blocks):
        raises as ``_end_hold`` does, or TimeoutError when the call's own
        ``timeout`` (``give_up_at``, monotonic) comes first."""
        try:
            until = hold.until
            if give_up_at is not None:
                until = min(until, self._clock() + give_up_at - time.monotonic())
            done = self._core.restart_gate.wait(lambda: self._held(hold), until, self._clock)
            if not done and until < hold.until:
                raise TimeoutError(f"{len(hold.records)} request(s) did not finish within "
                                   f"{timeout} s (fresh workers were still starting)")
            self._end_hold(hold, done)
        finally:
            hold.release()

    async def _hold_async(self, hold: _Hold) -> None:
        """``step_streaming``'s wait for fresh workers: the event loop runs on."""
        try:
            done = await self._core.restart_gate.wait_async(lambda: self._held(hold),
                                                            hold.until, self._clock)
            self._end_hold(hold, done)
        finally:
            hold.release()

    def _end_hold(self, hold: _Hold, done: bool) -> None:
        """The outcome of a hold (``done``: it ended before ``hold.until``):
        the records stand (the fresh workers serve them, an abort or a close
        ended them), or EngineDeadError when the restart gave up, or
        EngineRestartingError when the workers were still starting at
        ``hold.until`` — then the records are taken back unreported, as if
        refused at submission."""
        if self._core.dead_reason is not None:
            self.output_processor.discard(hold.records)  # ended already: streams closed
            raise EngineDeadError(f"engine is not healthy: {self._core.dead_reason}")
        if done or not self._core.withdraw(hold.records):  # else admitted meanwhile: served
            return
        self.output_processor.discard(hold.records)
        raise EngineRestartingError(
            f"the engine is restarting: fresh workers were not serving within "
            f"{hold.until - hold.since:g} s ({hold.bound}); retry shortly")

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
        self.output_processor.close()
        if self.inputs is not None:
            if self._restart_warmup is not None:
                release(self._restart_warmup, self.inputs)
            self.inputs.close()
        logger.info("engine closed")


def _restart_wait(config: EngineConfig) -> tuple[float, str]:
    """``restart_wait_s``, or the restart's worst case when it is None; and
    how the error past it names it."""
    ex = config.executor
    if ex.restart_wait_s is not None:
        return ex.restart_wait_s, f"restart_wait_s={ex.restart_wait_s:g}"
    worst = restart_worst_case_s(
        start_s=ex.startup_timeout_s + config.model_config.warmup_timeout_s,
        stop_s=ex.shutdown_grace_s + WORKER_STOP_SLACK_S)
    return worst, f"the longest a restart takes, {worst:g} s"


def _seconds(ms: float | None) -> float | None:
    """A window in ms as seconds; None (automatic) stays None."""
    return None if ms is None else ms / 1000.0
