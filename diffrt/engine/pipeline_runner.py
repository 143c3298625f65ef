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

Outputs are device tensors already reduced by the pipeline's ``to_transfer``
(uint8 images); the runtime moves them to the host on its output path.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.cache.state import CacheBudget
from diffrt.engine.cpu_policy import cpu_worker_threads
from diffrt.engine.input_images import InputPixels, read_pixels
from diffrt.engine.lora import adapter_file
from diffrt.engine.lora.loader import READY, AdapterLoader
from diffrt.engine.memory_trim import MemoryTrimmer
from diffrt.engine.parallel.degrees import ParallelDegrees
from diffrt.engine.parallel.groups import build_groups
from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.pipelines.load import load_pipeline
from diffrt.engine.pipelines.segments import resolve_mixed_rows
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.runner_messages import (
    PIPELINE_PROTOCOL,
    BatchDone,
    CountStepStates,
    CountWeights,
    DropLora,
    ExecuteBatch,
    ExecuteStep,
    LoadLora,
    LoraRows,
    LoraState,
    LoraStatus,
    RunnerSettings,
    StepDone,
    StepStateCount,
    WeightBytes,
)
from diffrt.engine.weights.prequantized import folder_methods
from diffrt.engine.weights.resident import resident_bytes
from diffrt.runtime.shm_transport import Arena
from diffrt.runtime.types import RankFailure, RunnerResult

if TYPE_CHECKING:
    from diffrt.engine.settings import ModelConfig
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    if is_out_of_memory(exc):
        return f"device out of memory: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a vendor's RuntimeError saying so (torch_npu,
    torch_musa and older stacks raise plain RuntimeErrors)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """``"auto"``: float32 on CPU; elsewhere bfloat16 where the device computes
    in it natively (``Platform.bf16_supported``: not the emulated bfloat16 of
    T4/V100 or Arc A-series), else float16."""
    if name != "auto":
        return _DTYPES[name]
    if platform.device_type == "cpu":
        return torch.float32
    try:
        supported = bool(platform.bf16_supported())
    except Exception:  # a backend that cannot tell: the safe half type
        supported = False
    return torch.bfloat16 if supported else torch.float16


def loads_on_host(model: ModelConfig, platform: Platform) -> bool:
    """Whether the weights load into host memory first, to be converted
    (``fp8-storage``, ``int8``) or offloaded before what stays on the device
    moves there: the full-precision model need not fit the device. ``fp8``'s
    torchao conversion runs on the device, so it loads there."""
    if platform.host_is_device or model.quantization == "fp8":
        return False
    return (model.quantization != "none" or model.text_encoder_quantization != "none"
            or model.offload != "none" or model.offload_text_encoders)


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


class PipelineRunner:
    """Loads the pipeline once per worker and runs engine ticks on it."""

    protocol = PIPELINE_PROTOCOL
    #: the input arena's mapping in this process (set by the worker core;
    #: None where the executor carries no inputs)
    inputs: Arena | None = None

    def __init__(self, settings: RunnerSettings, *, rank: int, world_size: int, platform: Platform):
        model, parallel = settings.model, settings.parallel
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
        self.pipeline.mixed_rows = resolve_mixed_rows(model.mixed_rows, platform)
        if model.quantization != "none" or model.text_encoder_quantization != "none":
            # before the parallel, LoRA and compile hooks: they see the quantised linears
            self.pipeline.quantize_weights(model.quantization, model.text_encoder_quantization)
        #: offload="layerwise": the blocks' host copies and device slots
        # the offloads copy to the worker's device, where the pipeline computes
        # once placed (a model loaded into host memory first is not there yet)
        self.offload = (self.pipeline.enable_layerwise_offload(
            platform, model.offload_prefetch, device=device)
            if model.offload == "layerwise" else None)
        #: offload="model" (every component) or offload_text_encoders (those only)
        self.model_offload = None
        texts = [n for n in self.pipeline.weight_modules() if n.startswith("text_encoder")]
        if model.offload == "model" or (model.offload_text_encoders and texts
                                        and not platform.host_is_device):
            self.model_offload = self.pipeline.enable_model_offload(
                platform, kept=() if model.offload == "model" else ("transformer", "vae"),
                device=device)
        if host_first:
            self.pipeline.place_weights(device, on_host=tuple(
                self.model_offload.managed) if self.model_offload is not None else ())
        saved = folder_methods(settings.spec.folder) if settings.spec.folder else {}
        #: the method each component runs with: as configured, or as the folder saved it
        self._methods: dict[str, str] = {name: saved.get(name) or (
            model.quantization if name == "transformer" else model.text_encoder_quantization
            if name.startswith("text_encoder") else "none")
            for name in self.pipeline.weight_modules()}
        self.pipeline.configure_memory(vae_tiling=model.vae_tiling, vae_slicing=model.vae_slicing)
        degrees = ParallelDegrees(cfg=parallel.cfg_parallel_size, ulysses=parallel.ulysses_degree,
                                  ring=parallel.ring_degree)
        #: several ranks share each request: a rank-local failure ends the rank
        self.parallel = degrees.world_size > 1
        self.vae_parallel = parallel.vae_parallel
        if self.parallel:  # every rank builds the same groups, in the same order
            self.pipeline.enable_parallel(build_groups(degrees),
                                          vae_parallel=parallel.vae_parallel)
        #: LoRA adapter files read on a thread of their own (None: the model takes none)
        self.adapters: AdapterLoader | None = None
        spec = settings.spec
        family_class = spec.diffusers_pipeline
        if spec.lora_target_modules and family_class is not None:
            linears = self.pipeline.enable_loras(model.max_loras)
            self.adapters = AdapterLoader(lambda path: adapter_file.read_adapter(
                path, family_class, linears, spec.lora_target_modules))
        if model.compile:  # after the parallel and LoRA hooks: they patch the eager model
            self.pipeline.compile_models(model.compile_backend)
        self.pipeline.enable_prompt_cache(model.prompt_cache_bytes,
                                          synchronize=self._wait_for_current_stream)
        #: text-encoding counters already reported to the engine.
        self._reported = self.pipeline.text_encoder_stats()
        self.states: dict[str, StepRequestState] = {}
        self.pipeline.cache_budget = CacheBudget(model.cache_state_bytes)
        #: gives memory back after an execute that ended requests far above the baseline
        self.memory = MemoryTrimmer(platform)
        # progress from inside a forward reaches the executor's watchdog
        self.pipeline.step_hook = lambda: self.heartbeat()
        logger.info("rank %d: runner ready for %s on %s", rank, settings.spec.name, device)

    def count_weights(self) -> WeightBytes:
        """Per component the bytes its storages hold, where; what offload keeps
        on the host; the peak on the device."""
        modules = self.pipeline.weight_modules()
        kind = self.platform.device_type
        managed = self.model_offload.managed if self.model_offload is not None else {}
        offloaded = {name: part.host_bytes for name, part in managed.items()}
        on_device = max(offloaded.values(), default=0)
        for name, module in modules.items():
            if name in managed:
                continue
            if name == "transformer" and self.offload is not None:
                offloaded[name] = self.offload.host_bytes
                blocks = [block.module for block in self.offload.blocks]
                on_device += (resident_bytes(module, skip=blocks).get(kind, 0)
                              + self.offload.device_bytes)
            else:
                on_device += resident_bytes(module).get(kind, 0)
        return WeightBytes({name: resident_bytes(module) for name, module in modules.items()},
                           self._methods, offloaded=offloaded, on_device=on_device)

    def handle(self, request: Any) -> Any:
        match request:
            case ExecuteBatch():
                missing = self._install_loras(request.lora_installs)
                self.memory.start_execute()
                result = self._reporting_encoding(self.execute_batch, request)
                result.reply.lora_missing = missing
                self._report_memory(result.reply, trim=True)
                return result
            case ExecuteStep():
                missing = self._install_loras(request.lora_installs)
                self.memory.start_execute()
                result = self._reporting_encoding(self.execute_step, request)
                result.reply.lora_missing = missing
                # trimmed only when a request left: its memory is free now, not
                # while it runs (trimming between its steps would fault it back
                # in each tick)
                self._report_memory(result.reply, trim=bool(
                    result.reply.finished or result.reply.errors or request.drop))
                return result
            case CountStepStates():
                return StepStateCount(len(self.states), self.pipeline.cache_budget.used(),
                                      sum(state.nbytes() for state in self.states.values()))
            case CountWeights():
                return self.count_weights()
            case LoadLora(adapter_id=adapter_id, path=path):
                self._loader().start(adapter_id, path)
                return LoraState("loading")
            case LoraStatus(adapter_id=adapter_id):
                state = self._loader().status(adapter_id)
                if state != READY:
                    return LoraState(state)
                weights = self._loader().get(adapter_id)
                return LoraState(READY, rank=weights.rank, modules=len(weights.modules),
                                 nbytes=weights.nbytes)
            case DropLora(adapter_ids=ids):
                for adapter_id in ids:
                    self._loader().drop(adapter_id)
                    slot = self.pipeline.row_loras.slot_of(adapter_id)
                    if slot is not None:
                        self.pipeline.row_loras.clear(slot)
                return LoraState("dropped")
            case _:
                raise TypeError(f"PipelineRunner cannot handle {type(request).__name__}")

    def _inputs_of(self, request: DiffusionRequest) -> InputPixels | None:
        """The request's input images, copied out of the input arena."""
        spec = self.pipeline.spec
        return read_pixels(request, self.inputs, lambda w, h: spec.input_size(request, w, h),
                           spec.prompt_image_size(request))

    def _loader(self) -> AdapterLoader:
        if self.adapters is None:
            raise RuntimeError("this model takes no LoRA adapters")
        return self.adapters

    def _install_loras(self, installs: dict[int, int]) -> list[int]:
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

    def _slots(self, uses: LoraRows) -> tuple[tuple[int, float], ...]:
        """A request's (slot, scale) pairs, each slot checked to hold the adapter
        the engine assigned it (a mismatch is a bug: never other pixels)."""
        for slot, adapter_id, _ in uses:
            entry = self.pipeline.row_loras.installed[slot]
            if entry is None or entry[0] != adapter_id:
                raise RuntimeError(f"LoRA slot {slot} does not hold adapter {adapter_id}")
        return tuple((slot, scale) for slot, _, scale in uses)

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

    def _failed(self, exc: BaseException) -> str:
        """The error a request gets for ``exc``; after an out-of-memory error the
        device's cached memory is given back first, so the retries (one request
        at a time) and the next ticks start from a clean allocator."""
        if is_out_of_memory(exc):
            logger.warning("device out of memory (%s); freeing the cache", exc)
            try:
                self.platform.empty_cache()
            except Exception:
                logger.exception("empty_cache failed")
        return describe_error(exc)

    def _report_memory(self, reply: BatchDone | StepDone, *, trim: bool) -> None:
        """Put in ``reply`` the execute's peak above the warm baseline, then
        trim if asked (the first trim takes the baseline: its reply also
        carries the free memory then)."""
        reply.peak_memory_bytes = self.memory.peak_above_baseline()
        if trim:
            first = self.memory.baseline is None
            self.memory.after_execute()
            if first:
                reply.free_memory_bytes = self.memory.free_at_baseline

    def _reporting_encoding(self, execute: Any, request: Any) -> RunnerResult:
        """Run ``execute(request)`` and put in its reply the text encoding done
        since the last reply (a tick that raised reports its work with the next)
        and the prompt tokens the text encoders cut, per request (logged once per
        request at DEBUG, as counts: a prompt's text is never logged)."""
        result = execute(request)
        now = self.pipeline.text_encoder_stats()
        if now is not None and self._reported is not None:
            result.reply.text_encoding = now - self._reported
            self._reported = now
        cuts = self.pipeline.take_prompt_cuts()
        for rid, per_encoder in cuts.items():
            logger.debug("request %s: prompt tokens cut by %s", rid, ", ".join(
                f"{encoder} {n}" for encoder, n in sorted(per_encoder.items())))
        result.reply.prompt_tokens_dropped = cuts
        result.reply.cache = self.pipeline.take_cache_metrics()
        return result

    # -- REQUEST_BATCH ------------------------------------------------------------
    def execute_batch(self, batch: ExecuteBatch) -> RunnerResult:
        requests = batch.requests
        outputs: dict[str, Any] = {}
        errors: dict[str, str] = {}
        rows = batch.lora_rows
        try:
            self._forward(requests, outputs, rows)
        except Exception as exc:
            self._end_if_shared(exc)
            if len(requests) == 1:
                errors[requests[0].request_id] = self._failed(exc)
            else:
                logger.warning("fused batch of %d failed (%s); isolating", len(requests),
                               self._failed(exc))
                outputs.clear()
                for request in requests:
                    try:
                        self._forward([request], outputs, rows)
                    except Exception as one:
                        errors[request.request_id] = self._failed(one)
        return RunnerResult(reply=BatchDone(errors=errors), outputs=outputs)

    def _forward(self, requests: list[DiffusionRequest], outputs: dict[str, Any],
                 lora_rows: dict[str, LoraRows]) -> None:
        loras = [self._slots(lora_rows.get(r.request_id, [])) for r in requests]
        inputs = [self._inputs_of(r) for r in requests]
        results = self.pipeline.forward(DiffusionRequestBatch(
            requests=list(requests), loras=loras if any(loras) else [],
            inputs=inputs if any(i is not None for i in inputs) else []))
        if len(results) != len(requests):
            raise RuntimeError(
                f"pipeline returned {len(results)} outputs for {len(requests)} requests")
        for request, tensor in zip(requests, results, strict=True):
            outputs[request.request_id] = self.pipeline.to_transfer(tensor, request.sampling_params)

    # -- STEP_BATCH -----------------------------------------------------------------
    def execute_step(self, step: ExecuteStep) -> RunnerResult:
        reply = StepDone()
        outputs: dict[str, Any] = {}
        for rid in step.drop:
            self._forget(rid)
        self._prepare(step.new, reply, step.lora_rows)
        if self.parallel and step.new:
            self._agree_on_prepared(step.new, reply)
        states = []
        for rid in step.advance:
            if rid in reply.errors:
                continue
            if rid not in self.states:
                reply.errors[rid] = "RuntimeError: no step state for this request in the worker"
                continue
            states.append(self.states[rid])
        for run in range(1, max(1, step.steps) + 1):
            self._advance(states, reply)
            reply.steps_run = run
            if any(self._boundary(state, reply) for state in states):
                break  # the batch changes here: back to the engine
        finished_states = []
        for state in states:
            rid = state.request_id
            if rid in reply.errors:
                self._forget(rid)
            elif state.finished:
                self._forget(rid)
                finished_states.append(state)
            else:
                reply.steps[rid] = state.step
                if step.report_state_bytes:
                    reply.state_bytes[rid] = state.nbytes()
                self._preview(state, reply, outputs)
        self._decode(finished_states, reply, outputs)
        for state in states:  # a failure still reports the steps it had done
            if state.request_id in reply.errors and state.step:
                reply.steps.setdefault(state.request_id, state.step)
        return RunnerResult(reply=reply, outputs=outputs)

    def _forget(self, rid: str) -> None:
        """Drop a request's step state; its step cache's tensors go at once."""
        state = self.states.pop(rid, None)
        if state is not None and state.cache is not None and not state.finished:
            state.cache.free()  # a finished one's metrics are taken when it is decoded

    @staticmethod
    def _boundary(state: StepRequestState, reply: StepDone) -> bool:
        """After this step ``state`` leaves the batch or wants an output."""
        return (state.request_id in reply.errors or state.finished
                or state.step in state.request.sampling_params.preview_steps())

    def _preview(self, state: StepRequestState, reply: StepDone,
                 outputs: dict[str, Any]) -> None:
        """A running request at one of its preview steps: its predicted image
        goes out as this tick's output. A failed preview is logged, not fatal:
        the request goes on to its final image."""
        steps = state.request.sampling_params.preview_steps()
        if state.step not in steps:
            return
        try:
            image = self.pipeline.decode_preview(state)
            if image is not None:
                outputs[state.request_id] = self.pipeline.to_transfer(
                    image, state.request.sampling_params)
                reply.previews[state.request_id] = steps.index(state.step)
        except Exception as exc:
            if self.vae_parallel:
                self._end_if_shared(exc)
            logger.warning("preview of %s failed: %s", state.request_id, describe_error(exc))

    def _prepare(self, requests: list[DiffusionRequest], reply: StepDone,
                 lora_rows: dict[str, LoraRows]) -> None:
        """Prepare the requests admitted in this tick together (one text-encoder
        call); on a failure, one by one so the error lands on its own request."""
        if not requests:
            return
        states = []
        for r in requests:
            try:
                states.append(StepRequestState(
                    request=r, loras=self._slots(lora_rows.get(r.request_id, [])),
                    inputs=self._inputs_of(r)))
            except (RuntimeError, ValueError) as exc:  # an empty adapter slot, an unreadable
                reply.errors[r.request_id] = describe_error(exc)  # input: it fails alone
        requests = [s.request for s in states]
        if not states:
            return
        try:
            self.pipeline.prepare_encode_batch(states)
        except Exception as exc:
            if len(states) == 1:
                reply.errors[requests[0].request_id] = self._failed(exc)
                return
            logger.warning("preparing %d together failed (%s); one by one", len(states),
                           self._failed(exc))
            for request in requests:
                self._prepare([request], reply, lora_rows)
            return
        for state in states:
            self.states[state.request_id] = state

    def _agree_on_prepared(self, requests: list[DiffusionRequest], reply: StepDone) -> None:
        """With several ranks, keep a new request only where every rank prepared
        it (preparing is local: a rank-local failure, out of memory on one
        device, must not leave the ranks with different batches)."""
        import torch.distributed as dist

        here = torch.tensor([r.request_id in self.states for r in requests], dtype=torch.int32,
                            device=self.pipeline.device)
        dist.all_reduce(here, op=dist.ReduceOp.MIN)
        for request, everywhere in zip(requests, here.tolist(), strict=True):
            rid = request.request_id
            if not everywhere and rid in self.states:
                self._forget(rid)
                reply.errors.setdefault(rid, "RuntimeError: preparing it failed on another rank")

    def _end_if_shared(self, exc: BaseException) -> None:
        """With several ranks, a failure inside work they share ends this rank
        (``RankFailure``): retrying alone would call collectives its peers are
        not in."""
        if self.parallel:
            raise RankFailure(f"failed in work shared with the other ranks: "
                              f"{describe_error(exc)}") from exc

    def _decode(self, states: list[StepRequestState], reply: StepDone,
                outputs: dict[str, Any]) -> None:
        """Decode the requests that finished in this tick in one call; on a
        failure, one by one so the error lands on its own request."""
        if not states:
            return
        try:
            decoded = self.pipeline.post_decode_batch(states)
            if len(decoded) != len(states):
                raise RuntimeError(f"post_decode_batch returned {len(decoded)} outputs "
                                   f"for {len(states)} requests")
        except Exception as exc:
            if self.vae_parallel:
                self._end_if_shared(exc)
            if len(states) == 1:
                reply.errors[states[0].request_id] = self._failed(exc)
                return
            logger.warning("decoding %d together failed (%s); one by one", len(states),
                           self._failed(exc))
            for state in states:
                self._decode([state], reply, outputs)
            return
        for state, out in zip(states, decoded, strict=True):
            rid = state.request_id
            try:
                outputs[rid] = self.pipeline.to_transfer(out, state.request.sampling_params)
                reply.finished.append(rid)
            except Exception as exc:
                reply.errors[rid] = self._failed(exc)

    def _advance(self, states: list[StepRequestState], reply: StepDone) -> None:
        """One denoise step for all ``states``; on a batch failure, retry each alone."""
        if not states:
            return
        try:
            preds = self._denoise(states)
        except Exception as exc:
            self._end_if_shared(exc)
            if len(states) == 1:
                reply.errors[states[0].request_id] = self._failed(exc)
                return
            logger.warning("step batch of %d failed (%s); isolating", len(states),
                           self._failed(exc))
            for state in states:
                self._advance([state], reply)
            return
        for state, pred in zip(states, preds, strict=True):
            try:
                self.pipeline.apply_step(state, pred)
            except Exception as exc:
                reply.errors[state.request_id] = self._failed(exc)

    def _denoise(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        pred = self.pipeline.denoise_step(states)
        rows = sum(s.latents.shape[0] if s.latents is not None else 1 for s in states)
        if pred.shape[0] != rows:
            raise RuntimeError(f"denoise_step returned {pred.shape[0]} rows for {rows}")
        return self.pipeline.split_predictions(pred, states)

    # -- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        for rid in list(self.states):
            self._forget(rid)
        if self.adapters is not None:
            self.adapters.close()
