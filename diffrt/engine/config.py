"""EngineConfig: every engine knob, validated when the config is built.

Errors a user can cause raise ``EngineConfigError`` naming the field (or the
model) and what is allowed, before any process is started or weight loaded.
Model capabilities come from the pipeline class, which is resolved without
loading weights.
"""

from __future__ import annotations

import enum
import importlib
import math
from dataclasses import dataclass, field
from typing import Any

from diffrt.engine.cpu_policy import cpu_worker_env
from diffrt.engine.parallel.degrees import ParallelConfigError, ParallelDegrees
from diffrt.engine.runner_messages import PIPELINE_PROTOCOL, RunnerSettings
from diffrt.engine.sched.policy import POLICIES
from diffrt.runtime.types import ExecutorConfig, RunnerSpec

EXECUTOR_BACKENDS = ("mp", "inproc", "ray")
#: the runner every worker builds (imported only inside the workers).
PIPELINE_RUNNER_CLS = "diffrt.engine.pipeline_runner:PipelineRunner"
DTYPES = ("auto", "float32", "float16", "bfloat16")


#: ExecutorConfig fields that executor_options may set (the others have their own fields).
_EXECUTOR_OPTIONS = frozenset({"startup_timeout_s", "shutdown_grace_s", "output_queue_depth",
                               "worker_env", "ray_address", "ray_output_transport",
                               "ray_cpus_per_rank"})


class EngineMode(enum.Enum):
    REQUEST_BATCH = "request_batch"
    STEP_BATCH = "step_batch"


class EngineConfigError(ValueError):
    """A bad engine setting; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class EngineConfig:
    """How to run one model.

    Args:
        model: a model name (``diffrt-shapes``, the default; ``tiny-flux``,
            ``tiny-sd3``) or a local diffusers-format folder.
        step_execution: False -> REQUEST_BATCH (whole requests per forward),
            True -> STEP_BATCH (continuous batching at denoise-step granularity).
        max_num_seqs: capacity of the scheduler: how many requests share one
            forward (REQUEST_BATCH) or one denoise step (STEP_BATCH).
        request_batch_max_wait_ms: REQUEST_BATCH only: how long an idle engine
            may hold the first request of a new wave so a burst can join it
            (None, the default: automatic, as for step_batch_max_wait_ms).
        step_batch_max_wait_ms: STEP_BATCH only: the same window for a step
            batch that forms while nothing runs (joining a running batch never
            waits). None (the default) sizes the window from measured request
            run times (a tenth of their moving average, at most 50 ms; see
            ``sched.base``); 0 schedules at once. Irrelevant with max_num_seqs=1.
        compile: ``torch.compile`` each worker's denoiser (``compile_backend``,
            default inductor); it compiles on first use (the warm-up request)
            and once more when a shape first changes (then dynamic in it). A
            compile is a worker call without heartbeats: mind execute_timeout_s.
        cfg_parallel_size: 2 splits classifier-free guidance across two ranks
            (one computes the conditional branch, the other the unconditional;
            one all_gather per step). A batch without CFG shares its rows out
            between them instead. 1: off.
        ulysses_degree: N > 1 splits each transformer call's image tokens across
            N ranks, attention exchanging heads for tokens (Ulysses; the
            transformer's heads must divide by N).
        ring_degree: N > 1 splits the image tokens across N ranks with ring
            attention (key/value slices passed round the ranks; any head
            count). With ulysses_degree too: Ulysses inside, ring across (USP).
        vae_parallel: decode each image in horizontal bands, one per rank (the
            ranks the options above give), exchanging halo rows and norm
            statistics: the untiled decode's pixels. Not with vae_tiling.
            See docs/parallelism.md.
        max_steps_per_tick: STEP_BATCH only: denoise steps one worker call may
            run while no request waits to join (fewer round trips; a request
            arriving meanwhile waits at most this many steps). 1 = one step per
            call.
        async_output: None = auto (on where the platform supports it), True /
            False force the two-phase / synchronous output path.
        executor_backend: "mp" (worker processes, the default), "inproc" (one
            rank on a thread of this process) or "ray" (the ranks as Ray actors
            in a placement group, across machines if need be; the ``ray``
            extra; docs/scale-out.md).
        world_size: worker processes (ranks) per engine: None (the default) is
            cfg_parallel_size x ulysses_degree x ring_degree; a value given
            must equal that product. Every rank holds the full weights.
        output_timeout_s: how long to wait for an output once its compute is
            done; None = the runtime's default (env DIFFRT_OUTPUT_TIMEOUT_S).
        scheduling_policy: "fifo" (strict arrival order, with head-of-line blocking)
            or "skip_ahead" (compatible younger requests may join past an
            incompatible one, at most ``scheduling_max_bypass`` times each).
        warmup / warmup_timeout_s: run one tiny request at start-up, failing
            (and cleaning up) if it does not finish in time.
        dtype: weights dtype in the worker: "auto" (bfloat16 where the device
            supports it, else float16; float32 on CPU), or a dtype's name.
        postprocess_workers: threads that turn outputs into PIL images for asyncio
            consumers (a synchronous consumer converts in its own thread).
        torch_threads: intra-op threads of torch in each worker. None = auto:
            on CPU, the usable cores split among the ranks minus one for the
            engine process (OpenMP oversubscription can slow a step down by an
            order of magnitude); elsewhere torch's default.
        max_pending_output_bytes: bound on the bytes of finished outputs that no
            consumer has taken yet, wherever they sit (None = the runtime's
            default, 2 GiB). At the bound the worker waits: nothing is dropped.
        unread_output_timeout_s: an output nobody has read for this long is
            released and its request ends with error "output expired"
            (None = kept while its consumer is connected).
        max_request_cost: the largest request admitted, in megapixel-steps
            (height x width x steps x outputs / 10^6, doubled with CFG); None = no
            limit. The default 1000 admits 1024x1024 x 50 steps x 8 outputs
            with CFG and refuses e.g. 2048x2048 x 28 steps x 16 outputs.
        request_timeout_s: seconds from submission to the final output after
            which a request is ended with an error (``SamplingParams.timeout_s``
            may lower it); None = no limit.
        execute_timeout_s: seconds an execute call may go without a sign of
            progress (a tick's reply, a per-denoise-step heartbeat) before the
            workers are declared hung, killed, and every pending request
            fails; None disables. Enforced by the multiprocess executor only
            (the in-process one cannot kill its worker thread).
        restart_workers: after the workers died or hung, fail only the
            requests that were running, start fresh workers (3 attempts,
            back-off from 1 s), warm them up and serve the waiting requests;
            ``is_healthy()`` is False only while no worker serves.
        prompt_cache_bytes: prompt embeddings each worker keeps (LRU by bytes,
            keyed by prompt text per text encoder); 0 disables the cache.
        vae_tiling / vae_slicing: decode in overlapping tiles (large images) /
            one image at a time (large batches), to save device memory.
        offload_text_encoders: keep text encoders on the CPU between encodings.
        plugin_modules: modules imported before the model is resolved, here
            and in each worker, e.g. one that registers a custom pipeline class.
        executor_options: extra ExecutorConfig fields (tuning: startup_timeout_s,
            shutdown_grace_s, output_queue_depth, worker_env).
    """

    model: str = "diffrt-shapes"
    step_execution: bool = False
    max_num_seqs: int = 1
    request_batch_max_wait_ms: float | None = None
    step_batch_max_wait_ms: float | None = None
    max_steps_per_tick: int = 4
    compile: bool = False
    compile_backend: str = "inductor"
    cfg_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    vae_parallel: bool = False
    async_output: bool | None = None
    executor_backend: str = "mp"
    world_size: int | None = None
    output_timeout_s: float | None = None
    scheduling_policy: str = "fifo"
    scheduling_max_bypass: int = 4
    warmup: bool = True
    warmup_timeout_s: float = 300.0
    dtype: str = "auto"
    postprocess_workers: int = 2
    torch_threads: int | None = None
    max_pending_output_bytes: int | None = None
    unread_output_timeout_s: float | None = None
    max_request_cost: float | None = 1000.0
    prompt_cache_bytes: int = 64 << 20
    vae_tiling: bool = False
    vae_slicing: bool = False
    offload_text_encoders: bool = False
    request_timeout_s: float | None = 600.0
    execute_timeout_s: float | None = 300.0
    restart_workers: bool = False
    plugin_modules: tuple[str, ...] = ()
    executor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_model()

    @property
    def mode(self) -> EngineMode:
        return EngineMode.STEP_BATCH if self.step_execution else EngineMode.REQUEST_BATCH

    def pipeline_class(self) -> type:
        from diffrt.engine.pipelines.registry import resolve_pipeline_class

        return resolve_pipeline_class(self.model)

    def executor_config(self, *, platform: Any) -> ExecutorConfig:
        """The runtime settings this config implies on ``platform`` (whether it
        supports the two-phase output decides ``async_output=None``; a CPU
        worker starts with the allocator policy of ``cpu_policy``)."""
        kw: dict[str, Any] = dict(self.executor_options)
        self._check_devices(platform)
        kw["worker_env"] = {**cpu_worker_env(platform), **kw.get("worker_env", {})}
        platform_async_output = bool(platform.supports_async_output)
        if self.output_timeout_s is not None:
            kw["output_timeout_s"] = self.output_timeout_s
        if self.max_pending_output_bytes is not None:
            kw["max_pending_output_bytes"] = self.max_pending_output_bytes
        kw["execute_timeout_s"] = self.execute_timeout_s
        async_output = platform_async_output if self.async_output is None else self.async_output
        settings = RunnerSettings(model=self.model, dtype=self.dtype,
                                  torch_threads=self.torch_threads,
                                  plugin_modules=list(self.plugin_modules),
                                  prompt_cache_bytes=self.prompt_cache_bytes,
                                  vae_tiling=self.vae_tiling, vae_slicing=self.vae_slicing,
                                  offload_text_encoders=self.offload_text_encoders,
                                  compile_backend=self.compile_backend if self.compile else None,
                                  cfg_parallel_size=self.cfg_parallel_size,
                                  ulysses_degree=self.ulysses_degree,
                                  ring_degree=self.ring_degree,
                                  vae_parallel=self.vae_parallel)
        runner = RunnerSpec(PIPELINE_RUNNER_CLS, PIPELINE_PROTOCOL, settings)
        return ExecutorConfig(runner=runner, world_size=self.ranks,
                              async_output=async_output, **kw)

    def _check_devices(self, platform: Any) -> None:
        """One device per rank on an accelerator (two ranks on one device would
        fail in the first collective). The ray backend takes its devices from
        the cluster, which checks them itself."""
        if platform.device_type == "cpu" or self.executor_backend == "ray" or self.ranks == 1:
            return
        devices = platform.device_count()
        if self.ranks > devices:
            field = next(n for n in ("ulysses_degree", "ring_degree", "cfg_parallel_size")
                         if getattr(self, n) > 1)
            raise EngineConfigError(field, (
                f"cfg_parallel_size x ulysses_degree x ring_degree = {self.ranks} ranks, one "
                f"device each, but {devices} {platform.device_type} device(s) are visible"))

    @property
    def ranks(self) -> int:
        """Worker ranks of the engine: the product of the parallel degrees
        (``world_size``, when given, equals it)."""
        return self.parallel_degrees().world_size

    def parallel_degrees(self) -> ParallelDegrees:
        """How each request is split over the ranks."""
        return ParallelDegrees(cfg=self.cfg_parallel_size, ulysses=self.ulysses_degree,
                               ring=self.ring_degree)

    # -- validation -------------------------------------------------------------
    def _check_fields(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise EngineConfigError("model", f"must be a non-empty str, got {self.model!r}")
        if not isinstance(self.step_execution, bool):
            raise EngineConfigError("step_execution", f"must be a bool, got {self.step_execution!r}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise EngineConfigError("max_num_seqs", f"must be an int >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.compile, bool):
            raise EngineConfigError("compile", f"must be a bool, got {self.compile!r}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise EngineConfigError("compile_backend",
                                    f"must be a backend name, got {self.compile_backend!r}")
        if not _is_int(self.max_steps_per_tick) or self.max_steps_per_tick < 1:
            raise EngineConfigError("max_steps_per_tick",
                                    f"must be an int >= 1, got {self.max_steps_per_tick!r}")
        for name in ("request_batch_max_wait_ms", "step_batch_max_wait_ms"):
            wait = getattr(self, name)
            if wait is not None and (not _is_number(wait) or wait < 0):
                raise EngineConfigError(name, f"must be None or a finite number >= 0, "
                                              f"got {wait!r}")
        if self.async_output not in (None, True, False):
            raise EngineConfigError("async_output", f"must be None, True or False, got {self.async_output!r}")
        if self.executor_backend not in EXECUTOR_BACKENDS:
            raise EngineConfigError("executor_backend",
                                    f"must be one of {EXECUTOR_BACKENDS}, got {self.executor_backend!r}")
        if self.cfg_parallel_size not in (1, 2):
            raise EngineConfigError("cfg_parallel_size",
                                    f"must be 1 or 2, got {self.cfg_parallel_size!r}")
        for name in ("ulysses_degree", "ring_degree"):
            degree = getattr(self, name)
            if not _is_int(degree) or degree < 1:
                raise EngineConfigError(name, f"must be an int >= 1, got {degree!r}")
        ranks = self.ranks
        if self.world_size is None:
            pass
        elif not _is_int(self.world_size) or self.world_size < 1:
            raise EngineConfigError("world_size", f"must be None or an int >= 1, "
                                                  f"got {self.world_size!r}")
        elif self.world_size != ranks:
            raise EngineConfigError("world_size", (
                f"{self.world_size} ranks, but cfg_parallel_size x ulysses_degree x ring_degree "
                f"= {self.cfg_parallel_size} x {self.ulysses_degree} x {self.ring_degree} = "
                f"{ranks}; leave world_size unset (it is their product). Ranks that would "
                "each run the whole pipeline add nothing"))
        if not isinstance(self.vae_parallel, bool):
            raise EngineConfigError("vae_parallel", f"must be a bool, got {self.vae_parallel!r}")
        if self.vae_parallel and ranks == 1:
            raise EngineConfigError("vae_parallel", "splits the decode over the ranks that "
                                    "cfg_parallel_size, ulysses_degree or ring_degree give; "
                                    "with one rank there is nothing to split")
        if self.vae_parallel and self.vae_tiling:
            raise EngineConfigError("vae_parallel", "decodes in bands over the ranks; "
                                    "vae_tiling is the one-rank way to save decode memory: "
                                    "use one of them")
        if self.executor_backend == "inproc" and self.ranks != 1:
            raise EngineConfigError("executor_backend", f"inproc runs exactly one rank; "
                                    f"{self.ranks} ranks need 'mp' or 'ray'")
        t = self.output_timeout_s
        if t is not None and (not _is_number(t) or t <= 0):
            raise EngineConfigError("output_timeout_s", f"must be None or a number > 0, got {t!r}")
        if self.scheduling_policy not in POLICIES:
            raise EngineConfigError("scheduling_policy",
                                    f"must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if not _is_int(self.scheduling_max_bypass) or self.scheduling_max_bypass < 0:
            raise EngineConfigError("scheduling_max_bypass",
                                    f"must be an int >= 0, got {self.scheduling_max_bypass!r}")
        if not _is_number(self.warmup_timeout_s) or self.warmup_timeout_s <= 0:
            raise EngineConfigError("warmup_timeout_s", f"must be a number > 0, got {self.warmup_timeout_s!r}")
        if self.dtype not in DTYPES:
            raise EngineConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not _is_int(self.postprocess_workers) or self.postprocess_workers < 1:
            raise EngineConfigError("postprocess_workers",
                                    f"must be an int >= 1, got {self.postprocess_workers!r}")
        n = self.torch_threads
        if n is not None and (not _is_int(n) or n < 1):
            raise EngineConfigError("torch_threads", f"must be None or an int >= 1, got {n!r}")
        b = self.max_pending_output_bytes
        if b is not None and (not _is_int(b) or b <= 0):
            raise EngineConfigError("max_pending_output_bytes", f"must be None or an int > 0, got {b!r}")
        for name in ("unread_output_timeout_s", "max_request_cost", "request_timeout_s",
                     "execute_timeout_s"):
            v = getattr(self, name)
            if v is not None and (not _is_number(v) or v <= 0):
                raise EngineConfigError(name, f"must be None or a number > 0, got {v!r}")
        for name in ("vae_tiling", "vae_slicing", "offload_text_encoders", "restart_workers"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.prompt_cache_bytes) or self.prompt_cache_bytes < 0:
            raise EngineConfigError("prompt_cache_bytes",
                                    f"must be an int >= 0, got {self.prompt_cache_bytes!r}")
        if isinstance(self.plugin_modules, str) or not all(
                isinstance(m, str) and m for m in self.plugin_modules):
            raise EngineConfigError("plugin_modules",
                                    f"must be a sequence of module names, got {self.plugin_modules!r}")
        self.plugin_modules = tuple(self.plugin_modules)
        unknown = set(self.executor_options) - _EXECUTOR_OPTIONS
        if unknown:
            raise EngineConfigError("executor_options", f"unknown option(s) {sorted(unknown)}; "
                                    f"allowed: {sorted(_EXECUTOR_OPTIONS)}")

    def _check_model(self) -> None:
        from diffrt.engine.pipelines.folder_check import ModelLoadError
        from diffrt.engine.pipelines.registry import UnknownModelError

        # The engine process resolves the model too (to check requests at
        # submission), so a plugin that registers it must be imported here as
        # well as in the workers.
        for name in self.plugin_modules:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise EngineConfigError("plugin_modules",
                                        f"cannot import {name!r}: {e}") from e
        try:
            cls = self.pipeline_class()
        except UnknownModelError as e:
            raise EngineConfigError("model", str(e)) from e
        except ModelLoadError as e:
            raise EngineConfigError("model", f"cannot load {self.model!r}: {e}") from e
        try:
            cls.check_parallel(self.parallel_degrees(), self.vae_parallel)
        except ParallelConfigError as e:
            raise EngineConfigError(e.field, str(e)) from e
        if self.step_execution and not getattr(cls, "supports_step_execution", False):
            raise EngineConfigError(
                "step_execution",
                f"model {self.model!r} ({cls.__name__}) does not implement the step protocol",
            )
        if (not self.step_execution and self.max_num_seqs > 1
                and not getattr(cls, "supports_request_batch", False)):
            raise EngineConfigError(
                "max_num_seqs",
                f"model {self.model!r} ({cls.__name__}) does not support request batching; "
                "use max_num_seqs=1 or step_execution=True",
            )
