"""Every engine setting, declared once: type, default, constraints and help.

Users pass one flat ``EngineConfig(model=..., max_num_seqs=...)``
(``config.py``); inside, each keyword lands in one of these groups, and each
room reads its own group: the worker its ``ModelConfig`` and
``ParallelConfig`` (they travel in ``RunnerSettings``), the schedulers the
``SchedulingConfig``, the submission checks the ``LimitsConfig``, the executors the
``ExecutorSettings`` (whose tuning fields are the runtime's own
``ExecutorOptions`` declaration). A field's ``msgspec.Meta`` gives its check
(``check_declared``: the error names the field), its CLI flag and help
(``cli/engine_opts.py``) and its line in the docs, so a new setting is one
declaration here plus the code that uses it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from diffrt.runtime.types import ExecutorBackend, ExecutorOptions

#: the shipped demo model (tiny, trained: its pictures follow the prompt)
DEFAULT_MODEL = "diffrt-shapes"
#: the shipped video demo model: what a video request runs when no model is
#: named (``diffrt generate --num-frames``; ``/v1/videos`` on a server of the
#: default model, on an engine of its own)
DEFAULT_VIDEO_MODEL = "diffrt-motion"
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Policy = Literal["fifo", "skip_ahead", "slo"]
MixedRows = Literal["auto", "padded", "by_size", "packed"]
#: lower-precision weights (``engine.weights.quantize``); text encoders run once
#: per prompt, so float8 matmuls would buy nothing there
QuantizationMethod = Literal["none", "fp8-storage", "int8", "fp8"]
TextQuantizationMethod = Literal["none", "fp8-storage", "int8"]
Offload = Literal["none", "layerwise", "model"]

#: the two coalescing windows, in ms: None (automatic) or a finite number >= 0
_AUTOMATIC = ("None (the default) sizes it from measured request run times (a tenth of "
              "their moving average, at most 50 ms); 0 schedules at once; irrelevant with "
              "max_num_seqs=1")
_RequestWaitMs = Annotated[Annotated[float, Meta(ge=0, le=3.6e6)] | None, Meta(description=(
    "REQUEST_BATCH only: how long an idle engine may hold the first request of a new wave "
    "so a burst can join it, in ms; " + _AUTOMATIC))]
_StepWaitMs = Annotated[Annotated[float, Meta(ge=0, le=3.6e6)] | None, Meta(description=(
    "STEP_BATCH only: the same window for a step batch that forms while nothing runs "
    "(joining a running batch never waits), in ms; " + _AUTOMATIC))]


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What each worker loads and how it runs it."""

    model: Annotated[str, Meta(min_length=1, description=(
        "a model name (diffrt-shapes, tiny-flux, tiny-sd3), a local diffusers folder, or a "
        "hub id in the local Hugging Face cache"))] = DEFAULT_MODEL
    dtype: Annotated[Dtype, Meta(description=(
        "weights dtype in the workers; auto: bfloat16 where the device supports it, else "
        "float16; float32 on CPU"))] = "auto"
    torch_threads: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description=(
        "torch intra-op threads in each worker; None: on CPU the usable cores split among "
        "the ranks minus one for the engine process (oversubscription can slow a step "
        "down by an order of magnitude), elsewhere torch's default"))] = None
    compile: Annotated[bool, Meta(description=(
        "torch.compile each worker's denoiser with compile_backend; it compiles at warm-up "
        "and once more when a shape first changes (mind execute_timeout_s)"))] = False
    compile_backend: Annotated[str, Meta(min_length=1, description=(
        "the torch.compile backend (with compile)"))] = "inductor"
    batch_invariant: Annotated[bool, Meta(description=(
        "every request runs as with SamplingParams.deterministic=True: its images and "
        "log-probs bit-identical whatever it is batched with, at the cost of the batching "
        "its rows give up (docs/rollouts.md; the request field's name on a command line, "
        "which takes both, is --deterministic)"))] = False
    prompt_cache_bytes: Annotated[int, Meta(ge=0, description=(
        "prompt embeddings each worker keeps (LRU by bytes, keyed by prompt text per text "
        "encoder); 0 disables the cache"))] = 64 << 20
    cache_state_bytes: Annotated[int, Meta(ge=0, description=(
        "step-cache state (cached residuals) each worker keeps for its running requests; "
        "a request whose state would not fit runs uncached and says so in its metrics"))] = (
        1 << 30)
    vae_tiling: Annotated[bool, Meta(description=(
        "decode in overlapping tiles (large images on one device)"))] = False
    vae_slicing: Annotated[bool, Meta(description=(
        "decode one image at a time (large batches on one device)"))] = False
    offload_text_encoders: Annotated[bool, Meta(description=(
        "offload='model' for the text encoders only: they live in page-locked host memory "
        "and move to the device for an encoding the prompt cache misses, the transformer "
        "and VAE staying there (small devices; nothing on CPU)"))] = False
    quantization: Annotated[QuantizationMethod, Meta(description=(
        "the transformer's weights: none (as loaded), fp8-storage (stored as float8 e4m3, "
        "cast per layer to the compute dtype; every device), int8 (weight-only, one scale "
        "per output channel, torchao; on CPU it saves memory, not time) or fp8 (float8 "
        "matmuls, torchao; only a device that has them)"))] = "none"
    text_encoder_quantization: Annotated[TextQuantizationMethod, Meta(description=(
        "the text encoders' weights: none, fp8-storage or int8, as quantization"))] = "none"
    offload: Annotated[Offload, Meta(description=(
        "layerwise: the transformer's blocks live in page-locked host memory and stream to "
        "the device ahead of use on a side stream (offload_prefetch blocks ahead), ordered "
        "by the platform's events; model: whole components (transformer, VAE, text "
        "encoders) live in page-locked host memory and each moves to the device when it "
        "runs, the others going back (the transformer stays for a request's steps); not on "
        "CPU, where host is device; none: all on the device"))] = "none"
    offload_prefetch: Annotated[int, Meta(ge=1, le=8, description=(
        "offload=layerwise: blocks copied ahead of the one running; the device holds "
        "offload_prefetch + 1 blocks"))] = 1
    device_memory_budget: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(
        extra={"unit": "bytes"}, description=(
            "the bytes each worker's weights may take on its device (the CLI takes 24GiB, "
            "512MiB): a configuration whose resident weights pass it is refused at start, "
            "naming the options that would make it fit; None: no bound"))] = None
    plugin_modules: Annotated[tuple[Annotated[str, Meta(min_length=1)], ...], Meta(description=(
        "modules imported before the model is resolved, here and in each worker, e.g. one "
        "that registers a model family"))] = ()
    mixed_rows: Annotated[MixedRows, Meta(description=(
        "STEP_BATCH with mixed_size_batching: how rows of different sizes share a step; "
        "padded: one transformer call, rows padded to the longest and masked; by_size: one "
        "call per size in the step; packed (Flux; other families pad): one call over all "
        "rows' tokens in one sequence, nothing padded; auto: by_size on CPU (as fast as "
        "any there, every family), padded on a device"))] = "auto"
    lora_modules: Annotated[dict[Annotated[str, Meta(min_length=1, max_length=256)],
                                 Annotated[str, Meta(min_length=1)]], Meta(description=(
        "LoRA adapters registered at start, name -> a safetensors file or folder in any "
        "format diffusers' load_lora_weights reads for the family (more at run time: "
        "DiffusionEngine.add_lora)"))] = {}
    max_loras: Annotated[int, Meta(ge=1, le=64, description=(
        "LoRA adapters each worker holds on the device at once (LRU; one a running request "
        "uses is never evicted), and the most one request may name"))] = 4
    lora_load_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds registering one LoRA adapter (reading and checking its file in every "
        "worker) may take"))] = 300.0
    warmup: Annotated[bool, Meta(description=(
        "run one tiny request at start-up, then three of growing sizes that calibrate the "
        "step-cost model (max_request_seconds, the token budget); fails and cleans up if one "
        "does not finish in warmup_timeout_s"))] = True
    warmup_timeout_s: Annotated[float, Meta(gt=0, description=(
        "seconds each start-up request (warm-up, calibration) may take"))] = 300.0


class SchedulingConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How requests are batched and ordered."""

    step_execution: Annotated[bool, Meta(description=(
        "False: REQUEST_BATCH (whole requests per forward); True: STEP_BATCH (continuous "
        "batching at denoise-step boundaries)"))] = False
    max_num_seqs: Annotated[int, Meta(ge=1, description=(
        "how many requests share one forward (REQUEST_BATCH) or one denoise step "
        "(STEP_BATCH)"))] = 1
    request_batch_max_wait_ms: _RequestWaitMs = None
    step_batch_max_wait_ms: _StepWaitMs = None
    max_steps_per_tick: Annotated[int, Meta(ge=1, description=(
        "STEP_BATCH: denoise steps one worker call may run while no request waits to join "
        "(a request arriving meanwhile waits at most this many steps); 1: one per call"))] = 4
    max_num_batched_tokens: Annotated[Annotated[int, Meta(ge=0)] | None, Meta(description=(
        "STEP_BATCH: the tokens one denoise step may compute: each row's (outputs, twice "
        "with CFG) text + image tokens, summed; with mixed_rows padded every row counts the "
        "longest row's; a request that would pass it waits "
        "for a later step (alone it always runs); None: derived from the step-cost model's "
        "calibrated idle speed (persisted: the same at every start); 0: no bound"))] = None
    mixed_size_batching: Annotated[bool, Meta(description=(
        "STEP_BATCH: requests of different sizes, output counts and output types share a "
        "denoise step (a model whose spec has mixed_sizes; not with ulysses/ring); False: "
        "only requests of one size do"))] = True
    share_steps: Annotated[Literal["cost", "always"], Meta(description=(
        "STEP_BATCH with mixed_size_batching: cost (a request of another size, adapter set "
        "or step cache joins a step only when the step-cost model predicts sharing finishes "
        "the requests sooner and pushes none past its deadline; on a CPU, where a call per "
        "size saves nothing, that is about never) or always (whenever the key allows)"
        ))] = "cost"
    scheduling_policy: Annotated[Policy, Meta(description=(
        "fifo (strict arrival order, head-of-line blocking), skip_ahead (compatible "
        "younger requests may pass an incompatible one, at most scheduling_max_bypass "
        "times each) or slo (by SamplingParams.priority, then least slack to deadline_s; "
        "STEP_BATCH pauses running requests at step boundaries for more urgent ones)"
        ))] = "fifo"
    scheduling_max_bypass: Annotated[int, Meta(ge=0, description=(
        "skip_ahead: how often one waiting request may be passed"))] = 4
    slo_aging_ticks: Annotated[int, Meta(ge=1, description=(
        "slo: every this many scheduler ticks a request waits (queued or paused) without "
        "a deadline or past it, it counts one priority class more urgent, so a sustained "
        "stream of urgent requests cannot starve it"))] = 16
    max_paused_state_bytes: Annotated[int, Meta(ge=0, description=(
        "slo, STEP_BATCH: the step state (latents, noise-scheduler state, step cache) that "
        "paused requests may keep in the workers, in bytes; at the bound no more running "
        "request is paused; 0: no preemption"))] = 1 << 30
    refuse_unmeetable: Annotated[bool, Meta(description=(
        "slo: refuse at submission (DeadlineUnmeetableError, HTTP 429 with Retry-After) a "
        "request whose deadline_s the queue ahead of it and its own estimated work "
        "would miss, instead of finishing it late"))] = False
    max_batch_memory_bytes: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description=(
        "the estimated peak activation memory (engine.memory_estimate) the requests of one "
        "batch may take together, in bytes; a request that would push a batch over it waits "
        "for a later tick (a request alone always runs, nothing is refused for it); None: "
        "a share of the memory the warm workers report free: half the host's available "
        "memory on CPU, 80% of a device's free memory"))] = None


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How one request is split over ranks (docs/parallelism.md)."""

    cfg_parallel_size: Annotated[Literal[1, 2], Meta(description=(
        "2: classifier-free guidance's two branches on two ranks (one all_gather per "
        "step); a batch without CFG shares its rows out instead"))] = 1
    ulysses_degree: Annotated[int, Meta(ge=1, description=(
        "split each transformer call's image tokens over N ranks, attention exchanging "
        "heads for tokens (the heads must divide by N)"))] = 1
    ring_degree: Annotated[int, Meta(ge=1, description=(
        "split the image tokens over N ranks with ring attention (any head count); with "
        "ulysses_degree: Ulysses inside, the ring across"))] = 1
    vae_parallel: Annotated[bool, Meta(description=(
        "decode each image in bands of rows, one per rank (exact: halo rows and shared "
        "norm statistics); not with vae_tiling"))] = False
    world_size: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description=(
        "worker ranks per engine: None is cfg_parallel_size x ulysses_degree x "
        "ring_degree, a value given must equal it"))] = None

    @property
    def ranks(self) -> int:
        return self.cfg_parallel_size * self.ulysses_degree * self.ring_degree


class LimitsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What one request may cost and how long it may take."""

    max_request_seconds: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description=(
        "the longest a request may be estimated to run on this engine, alone, in seconds "
        "at the calibrated idle speed (engine.run_time: the step-cost model's fastest "
        "calibration, persisted across starts; a loaded machine's slower steps do not "
        "change the verdict); a longer one is refused naming the estimate; None: no limit. "
        "Without warm-up or a persisted model nothing is refused until the first tick is "
        "measured"))] = 120.0
    request_timeout_s: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description=(
        "seconds from submission to the final output after which a request ends with an "
        "error (SamplingParams.timeout_s may lower it); None: no limit"))] = 600.0
    unread_output_timeout_s: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description=(
        "an output nobody has read for this long is released and its request ends with "
        "\"output expired\"; None: kept while its consumer is connected"))] = None


class ExecutorSettings(ExecutorOptions, kw_only=True, frozen=True):
    """Where the ranks run and how outputs come back (the runtime's
    ``ExecutorOptions`` plus what the engine decides for them)."""

    executor_backend: Annotated[ExecutorBackend, Meta(description=(
        "mp: worker processes; inproc: one rank on a thread of this process; ray: the "
        "ranks as Ray actors, across machines if need be (the ray extra)"))] = "mp"
    async_output: Annotated[bool | None, Meta(description=(
        "copy outputs off the device on a background thread; None: where the platform "
        "supports it"))] = None
    restart_workers: Annotated[bool, Meta(description=(
        "after the workers died or hung, fail only the running requests, start fresh "
        "workers (3 attempts) and serve the waiting ones, and those submitted meanwhile "
        "(restart_wait_s)"))] = False
    restart_wait_s: Annotated[Annotated[float, Meta(ge=0)] | None, Meta(description=(
        "with restart_workers: how long a request submitted while fresh workers start "
        "waits for them (queued, counted as waiting) before it is refused with "
        "EngineRestartingError (HTTP 503 with Retry-After); never past its own timeout; "
        "0: refused at once; None: as long as the restart can take (3 x "
        "(startup_timeout_s + warmup_timeout_s), plus the back-offs and the workers' "
        "shutdowns)"))] = None
    stall_timeout_s: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description=(
        "seconds an execute call may go without a sign of progress (a reply, an output, a "
        "per-step heartbeat) before the engine reports itself stalled (stall(); diffrt "
        "serve: /health and /ready 503 until progress resumes). It only reports: the "
        "workers are killed at execute_timeout_s. None: never"))] = 30.0
    postprocess_workers: Annotated[int, Meta(ge=1, description=(
        "threads that turn outputs into PIL images for asyncio consumers"))] = 2


#: group attribute of EngineConfig -> its declaration, in the order the docs list them
GROUPS: dict[str, type[msgspec.Struct]] = {
    "model_config": ModelConfig, "scheduling": SchedulingConfig, "parallel": ParallelConfig,
    "limits": LimitsConfig, "executor": ExecutorSettings}
#: setting name -> the group attribute that holds it
FIELD_GROUP: dict[str, str] = {name: group for group, cls in GROUPS.items()
                               for name in cls.__struct_fields__}


__all__ = ["DEFAULT_MODEL", "DEFAULT_VIDEO_MODEL", "FIELD_GROUP", "GROUPS", "ExecutorSettings", "LimitsConfig",
           "ModelConfig", "ParallelConfig", "SchedulingConfig"]
