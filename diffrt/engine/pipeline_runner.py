"""PipelineRunner: the engine's code inside each worker.

The runtime builds it in every worker from ``RunnerSettings`` and hands it the
engine's typed requests (``runner_messages``), one per scheduler tick:

* ``ExecuteBatch`` (REQUEST_BATCH): whole requests, fused when several. When
  a fused forward raises, the members are re-run one by one so the error is
  mapped to the request that caused it and the others still get their output.
* ``ExecuteStep`` (STEP_BATCH): prepares new requests (``prepare_encode``),
  drops the state of aborted ones, advances every scheduled request by one
  denoise step in one batch, and decodes those that reached their step count.
  Request state (``StepRequestState``) lives here, keyed by request id.

The set-up is one plan (``worker_setup.PLAN``): load, then the features in
their declared order, each leaving a handle kept here (``handles``). The
execution of ticks and its failure isolation live in ``runner_steps``.
Every execute is answered with one ``TickReport``.

Outputs are device tensors already reduced by the pipeline's ``to_transfer``
(uint8 images); the runtime moves them to the host on its output path.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import torch

from diffrt.engine.cpu_policy import cpu_worker_threads
from diffrt.engine.lora.loader import READY, AdapterLoader
from diffrt.engine.memory_trim import MemoryTrimmer
from diffrt.engine.pipelines.interface import DiffusionPipeline, StepRequestState
from diffrt.engine.pipelines.load import load_pipeline
from diffrt.engine.runner_messages import (
    PIPELINE_PROTOCOL,
    AdapterState,
    AdapterStatus,
    CommitWeights,
    CountStepStates,
    CountWeights,
    DiscardWeights,
    DropAdapters,
    ExecuteBatch,
    ExecuteStep,
    ForgetPreviousWeights,
    LoadAdapter,
    RevertWeights,
    RunnerReply,
    RunnerRequest,
    RunnerSettings,
    SleepReport,
    SleepWorkers,
    StageWeights,
    StepStateCount,
    TickReport,
    WakeWorkers,
    WeightBytes,
    WeightsStaged,
)
from diffrt.engine.runner_steps import TickRunner, describe_error, is_out_of_memory
from diffrt.engine.setup_checks import resolve_dtype
from diffrt.engine.weights.resident import resident_bytes
from diffrt.engine.weights.sleep import SleepingWeights
from diffrt.engine.weights.update import PreviousWeights, StagedUpdate, WeightUpdateError
from diffrt.engine.worker_setup import WorkerPlace, apply_plan, loads_on_host
from diffrt.runtime.types import RunnerResult

if TYPE_CHECKING:
    from diffrt.engine.weights.model_offload import ModelOffload
    from diffrt.engine.weights.offload import LayerwiseOffload
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


def rank_device(platform: Platform, rank: int) -> torch.device:
    """The device of ``rank``, made this process's device (``set_device``), so
    tensors, streams and events agree: ``rank % device_count`` where a worker
    sees several devices (pinning failed or was not possible), 0 where it was
    pinned to one. CPU: the host."""
    if platform.device_type == "cpu":
        return platform.torch_device(None)
    index = rank % max(1, platform.device_count())
    platform.set_device(index)
    return platform.torch_device(index)


class PipelineRunner(TickRunner):
    """Loads the pipeline once per worker and runs engine ticks on it."""

    protocol = PIPELINE_PROTOCOL

    def __init__(self, settings: RunnerSettings, *, rank: int, world_size: int, platform: Platform):
        model = settings.model
        threads = model.torch_threads or cpu_worker_threads(platform, world_size)
        if threads:
            torch.set_num_threads(threads)
        for name in model.plugin_modules:
            importlib.import_module(name)
        self.rank = rank
        self.world_size = world_size
        self.platform = platform
        device = rank_device(platform, rank)
        host_first = loads_on_host(model, platform)
        self.pipeline: DiffusionPipeline = load_pipeline(
            settings.spec, device=torch.device("cpu") if host_first else device,
            dtype=resolve_dtype(model.dtype, platform))
        #: what each step of the set-up plan left, by step name (``worker_setup``)
        self.handles = apply_plan(self.pipeline, settings, platform, WorkerPlace(
            device=device, spec=settings.spec, host_first=host_first,
            heartbeat=lambda: self.heartbeat(), synchronize=self._wait_for_current_stream))
        self.parallel = self.handles.parallel
        self.vae_parallel = settings.parallel.vae_parallel
        #: text-encoding counters already reported to the engine.
        self._reported = self.pipeline.text_encoder_stats()
        self.states: dict[str, StepRequestState] = {}
        #: gives memory back after an execute that ended requests far above the baseline
        self.memory = MemoryTrimmer(platform)
        #: a weight update read and checked, waiting for the engine's commit
        self.staged: StagedUpdate | None = None
        #: what the last commit replaced, kept when the engine asked (a roll-back)
        self.previous: PreviousWeights | None = None
        #: the weights put away while the engine sleeps
        self.asleep: SleepingWeights | None = None
        logger.info("rank %d: runner ready for %s on %s", rank, settings.spec.name, device)

    # -- what the plan's steps left ------------------------------------------------------
    @property
    def offload(self) -> LayerwiseOffload | None:
        return self.handles.offload

    @property
    def model_offload(self) -> ModelOffload | None:
        return self.handles.model_offload

    @property
    def adapters(self) -> AdapterLoader | None:
        return self.handles.lora

    def count_weights(self) -> WeightBytes:
        """Per component the bytes its storages hold, where; what offload keeps
        on the host; the peak on the device."""
        modules = self.pipeline.weight_modules()
        kind = self.platform.device_type
        offload, model_offload = self.offload, self.model_offload
        managed = model_offload.managed if model_offload is not None else {}
        offloaded = {name: part.host_bytes for name, part in managed.items()}
        on_device = max(offloaded.values(), default=0)
        if offload is not None:  # the slots, shared by every streamed transformer
            on_device += offload.device_bytes
        for name, module in modules.items():
            if name in managed:
                continue
            inside = {id(m) for m in module.modules()}
            streamed = [] if offload is None else [b for b in offload.blocks
                                                   if id(b.module) in inside]
            if streamed:  # its blocks in host memory (Wan 2.2: each expert's)
                offloaded[name] = sum(block.host.numel() for block in streamed)
                on_device += resident_bytes(
                    module, skip=[block.module for block in streamed]).get(kind, 0)
            else:
                on_device += resident_bytes(module).get(kind, 0)
        return WeightBytes({name: resident_bytes(module) for name, module in modules.items()},
                           self.handles.weights, offloaded=offloaded, on_device=on_device)

    def handle(self, request: RunnerRequest) -> RunnerResult | RunnerReply:
        match request:
            case ExecuteBatch():
                missing = self._install_adapters(request.adapter_installs)
                self.memory.start_execute()
                result = self._reporting(self.execute_batch(request))
                result.reply.empty_adapter_slots = missing
                self._report_memory(result.reply, trim=True)
                return result
            case ExecuteStep():
                missing = self._install_adapters(request.adapter_installs)
                self.memory.start_execute()
                result = self._reporting(self.execute_step(request))
                reply = result.reply
                reply.empty_adapter_slots = missing
                # trimmed only when a request left: its memory is free now, not
                # while it runs (trimming between its steps would fault it back
                # in each tick)
                self._report_memory(reply, trim=bool(
                    (reply.step is not None and reply.step.finished) or reply.errors
                    or request.drop))
                return result
            case CountStepStates():
                return StepStateCount(len(self.states), self.handles.cache_budget.used(),
                                      sum(state.nbytes() for state in self.states.values()))
            case CountWeights():
                return self.count_weights()
            case LoadAdapter(adapter_id=adapter_id, path=path):
                self._loader().start(adapter_id, path)
                return AdapterState("loading")
            case AdapterStatus(adapter_id=adapter_id):
                state = self._loader().status(adapter_id)
                if state != READY:
                    return AdapterState(state)
                weights = self._loader().get(adapter_id)
                return AdapterState(READY, rank=weights.rank, modules=len(weights.modules),
                                 nbytes=weights.nbytes)
            case DropAdapters(adapter_ids=ids):
                for adapter_id in ids:
                    self._loader().drop(adapter_id)
                    slot = self.pipeline.row_loras.slot_of(adapter_id)
                    if slot is not None:
                        self.pipeline.row_loras.clear(slot)
                return AdapterState("dropped")
            case (StageWeights() | CommitWeights() | DiscardWeights() | RevertWeights()
                  | ForgetPreviousWeights()):
                return self._weight_update(request)
            case SleepWorkers(level=level):
                if level == 2:  # waking reads the folder: the kept copy would outlive its weights
                    self.previous = None
                if self.asleep is None:
                    self.asleep = SleepingWeights(self.pipeline.weight_modules(), self.platform,
                                                  self.pipeline.device, level,
                                                  self.pipeline.spec.folder)
                return SleepReport(self.asleep.freed_bytes, self.asleep.pinned_bytes)
            case WakeWorkers():
                asleep, self.asleep = self.asleep, None
                if asleep is None:
                    return SleepReport()
                reloaded = asleep.reloads
                return SleepReport(restored_bytes=asleep.wake(), reloaded=reloaded)
            case _:
                raise TypeError(f"PipelineRunner cannot handle {type(request).__name__}")

    def _weight_update(self, request: StageWeights | CommitWeights | DiscardWeights
                       | RevertWeights | ForgetPreviousWeights) -> WeightsStaged:
        """The two phases of a weight update (``weights.update``)."""
        staged, self.staged = self.staged, None
        match request:
            case StageWeights(path=path):
                transformer = getattr(self.pipeline, "transformer", None)
                if not isinstance(transformer, torch.nn.Module):
                    return WeightsStaged(error=f"{self.pipeline.name} has no transformer to update")
                if getattr(self.pipeline, "transformer_2", None) is not None:
                    # Wan 2.2's low-noise expert would keep its weights: a
                    # version naming half of the model's weights is refused
                    return WeightsStaged(error=(
                        f"{self.pipeline.name} has a second expert (transformer_2) that "
                        "update_weights does not update"))
                try:
                    self.staged = StagedUpdate(transformer, path)
                except (WeightUpdateError, OSError, RuntimeError) as exc:
                    return WeightsStaged(error=f"{type(exc).__name__}: {exc}")
                return WeightsStaged(self.staged.checksum, len(self.staged.tensors),
                                     self.staged.nbytes)
            case CommitWeights(keep_previous=keep):
                if staged is None:
                    return WeightsStaged(error="no weights staged")
                self.previous = staged.commit(keep)
                self.platform.synchronize()
            case RevertWeights():
                previous, self.previous = self.previous, None
                if previous is None:
                    return WeightsStaged(error="no previous weights kept")
                restored = previous.restore()
                self.platform.synchronize()
                return WeightsStaged(restored, len(previous.tensors), previous.nbytes)
            case ForgetPreviousWeights():
                self.previous = None
        return WeightsStaged()

    def _loader(self) -> AdapterLoader:
        if self.adapters is None:
            raise RuntimeError("this model takes no LoRA adapters")
        return self.adapters

    def _install_adapters(self, installs: dict[int, int]) -> list[int]:
        """Copy the adapters the engine assigned to device slots since the last
        execute into them, before this execute's rows use them; the slots that
        could not be filled — with the others a failure left empty — so the
        engine forgets those assignments (the requests naming them fail alone)."""
        if not installs:
            return []
        slots = self.pipeline.row_loras
        for slot, adapter_id in installs.items():
            try:
                slots.install(slot, adapter_id, self._loader().get(adapter_id))
            except Exception as exc:
                logger.error("LoRA adapter %d could not go into slot %d: %s", adapter_id, slot,
                             self._failed(exc))
        return [slot for slot, entry in enumerate(slots.installed) if entry is None]

    def _wait_for_current_stream(self) -> None:
        """Wait for the work queued on this thread's stream (the text encoder's),
        not the whole device: a device-wide synchronize would also wait for the
        output thread's copy of the previous request. A backend without events
        copies outputs synchronously, so there the device-wide wait costs nothing
        extra (and on CPU there is nothing to wait for)."""
        event = self.platform.record_device_event()
        if event is not None:
            self.platform.event_synchronize(event)
        elif self.platform.device_type != "cpu":
            self.platform.synchronize()

    def heartbeat(self) -> None:
        """Replaced by the runtime's worker with one that tells the executor
        this worker made progress (``WorkerCore``); a no-op until then."""

    def _report_memory(self, reply: TickReport, *, trim: bool) -> None:
        """Put in ``reply`` the execute's peak above the warm baseline, then
        trim if asked (the first trim takes the baseline: its reply also
        carries the free memory then)."""
        reply.peak_memory_bytes = self.memory.peak_above_baseline()
        if trim:
            first = self.memory.baseline is None
            self.memory.after_execute()
            if first:
                reply.free_memory_bytes = self.memory.free_at_baseline

    def _reporting(self, result: RunnerResult) -> RunnerResult:
        """Put in ``result``'s reply the text encoding done since the last reply
        (a tick that raised reports its work with the next) and the prompt
        tokens the text encoders cut, per request (logged once per request at
        DEBUG, as counts: a prompt's text is never logged)."""
        reply: TickReport = result.reply
        now = self.pipeline.text_encoder_stats()
        if now is not None and self._reported is not None:
            reply.text_encoding = now - self._reported
            self._reported = now
        cuts = self.pipeline.take_prompt_cuts()
        for rid, per_encoder in cuts.items():
            logger.debug("request %s: prompt tokens cut by %s", rid, ", ".join(
                f"{encoder} {n}" for encoder, n in sorted(per_encoder.items())))
        reply.prompt_tokens_dropped = cuts
        reply.cache = self.pipeline.take_cache_metrics()
        return result

    # -- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        for rid in list(self.states):
            self._forget(rid)
        if self.adapters is not None:
            self.adapters.close()


__all__ = ["PipelineRunner", "describe_error", "is_out_of_memory", "rank_device",
           "resolve_dtype"]
