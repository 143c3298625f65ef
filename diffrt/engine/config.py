"""EngineConfig: every engine setting, each checked when the config is built.

Users pass one flat ``EngineConfig(model=..., max_num_seqs=...)``; each
keyword is declared once in ``settings.py`` and lands in its group
(``config.model_config``, ``.scheduling``, ``.parallel``, ``.limits``,
``.executor``), which the rooms of the engine read. Errors a user can cause
raise ``EngineConfigError`` naming the field (or the model) and what is
allowed, before any process is started or weight loaded. Building a config
reads nothing: the model's ``ModelSpec`` is resolved (without weights) and
checked against the settings on its first use (``model_spec()``), and what
the platform and the model's folder refuse is the dry run of the workers'
set-up plan (``executor_config``, ``worker_setup.dry_run``) when the engine
starts.
"""

from __future__ import annotations

import difflib
import enum
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from diffrt.engine.cpu_policy import cpu_worker_env
from diffrt.engine.errors import EngineConfigError
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.parallel.degrees import ParallelConfigError, ParallelDegrees
from diffrt.engine.runner_messages import PIPELINE_PROTOCOL, RunnerSettings
from diffrt.engine.settings import (
    FIELD_GROUP,
    GROUPS,
    ExecutorSettings,
    LimitsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulingConfig,
)
from diffrt.engine.setup_checks import usable_methods
from diffrt.runtime.types import (
    DeclaredValueError,
    ExecutorConfig,
    ExecutorOptions,
    RunnerSpec,
    convert_declared,
)

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: the runner every worker builds (imported only inside the workers).
PIPELINE_RUNNER_CLS = "diffrt.engine.pipeline_runner:PipelineRunner"


class ExecutionMode(enum.Enum):
    REQUEST_BATCH = "request_batch"
    STEP_BATCH = "step_batch"


class EngineConfig:
    """How to run one model: the flat keywords of ``settings.py``'s groups
    (``EngineConfig.fields()`` lists them; docs/engine.md explains each).

    ``config.max_num_seqs`` reads a setting; the groups (``config.scheduling``
    ...) are what the engine's rooms read. An unknown keyword raises
    ``EngineConfigError`` naming it and the nearest setting.
    """

    model_config: ModelConfig
    scheduling: SchedulingConfig
    parallel: ParallelConfig
    limits: LimitsConfig
    executor: ExecutorSettings

    def __init__(self, **settings: object) -> None:
        given: dict[str, dict[str, object]] = {group: {} for group in GROUPS}
        for name, value in settings.items():
            group = FIELD_GROUP.get(name)
            if group is None:
                near = difflib.get_close_matches(name, FIELD_GROUP, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise EngineConfigError(name, f"not an EngineConfig setting{hint}")
            given[group][name] = value
        for group, cls in GROUPS.items():
            try:
                struct = convert_declared(cls, given[group])
            except DeclaredValueError as exc:
                raise EngineConfigError(exc.field, exc.reason) from None
            object.__setattr__(self, group, struct)
        self._check_combinations()

    # -- reading ----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """A setting by its flat name (``config.max_num_seqs``)."""
        group = FIELD_GROUP.get(name)
        if group is None or name.startswith("__"):
            raise AttributeError(f"EngineConfig has no setting {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("EngineConfig is immutable: use config.replace(...)")

    @staticmethod
    def fields() -> list[str]:
        """Every setting's name, in declaration order."""
        return list(FIELD_GROUP)

    def settings(self) -> dict[str, object]:
        """Every setting and its value (what ``EngineConfig(**...)`` takes back)."""
        return {name: getattr(getattr(self, group), name) for name, group in FIELD_GROUP.items()}

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes``, checked as a new config is."""
        return EngineConfig(**{**self.settings(), **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and self.settings() == other.settings()

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self.settings().items())))

    def __repr__(self) -> str:
        if "executor" not in self.__dict__:  # failed half-way through __init__
            return "EngineConfig(<incomplete>)"
        defaults = EngineConfig._defaults()
        changed = ", ".join(f"{k}={v!r}" for k, v in self.settings().items()
                            if defaults.get(k, object()) != v)
        return f"EngineConfig({changed})"

    def __reduce__(self) -> tuple[Callable[[dict[str, object]], EngineConfig],
                                  tuple[dict[str, object]]]:  # Ray ships configs to replicas
        return (_rebuild, (self.settings(),))

    @staticmethod
    def _defaults() -> dict[str, object]:
        return {name: getattr(cls(), name) for cls in GROUPS.values()
                for name in cls.__struct_fields__}

    @property
    def mode(self) -> ExecutionMode:
        return ExecutionMode.STEP_BATCH if self.scheduling.step_execution else ExecutionMode.REQUEST_BATCH

    def model_spec(self) -> ModelSpec:
        """The model's description (resolved once per folder, without weights),
        checked against these settings: ``EngineConfigError`` naming the field
        the model refuses. The first call reads the model (its plugins, its
        folder); the config's construction reads nothing."""
        spec = self.__dict__.get("_spec")
        if spec is None:
            spec = self._resolve_model()
            object.__setattr__(self, "_spec", spec)
        return spec

    @property
    def ranks(self) -> int:
        """Worker ranks of the engine: the product of the parallel degrees
        (``world_size``, when given, equals it)."""
        return self.parallel.ranks

    def parallel_degrees(self) -> ParallelDegrees:
        """How each request is split over the ranks."""
        p = self.parallel
        return ParallelDegrees(cfg=p.cfg_parallel_size, ulysses=p.ulysses_degree,
                               ring=p.ring_degree)

    # -- what the runtime receives --------------------------------------------------------------
    def executor_config(self, *, platform: Platform) -> ExecutorConfig:
        """The runtime settings this config implies on ``platform`` (whether it
        supports the two-phase output decides ``async_output=None``; a CPU
        worker starts with the allocator policy of ``cpu_policy``). It runs
        the dry run of the workers' set-up plan (``worker_setup.dry_run``)
        first: a setting the model's folder or the platform refuses fails
        here, before any worker loads weights."""
        from diffrt.engine.worker_setup import dry_run

        self._check_devices(platform)
        ex = self.executor
        spec = self.model_spec()
        settings = RunnerSettings(spec=spec, model=self.model_config, parallel=self.parallel)
        dry_run(settings, platform)  # what the workers' set-up would refuse, before they start
        options = {name: getattr(ex, name) for name in ExecutorOptions.__struct_fields__}
        options["worker_env"] = {**cpu_worker_env(platform), **ex.worker_env}
        options["max_pending_output_bytes"] = min(ex.max_pending_output_bytes,
                                                  self.output_arena_bytes(spec))
        async_output = (bool(platform.supports_async_output) if ex.async_output is None
                        else ex.async_output)
        runner = RunnerSpec(PIPELINE_RUNNER_CLS, PIPELINE_PROTOCOL, settings)
        return ExecutorConfig(runner=runner, world_size=self.ranks,
                              async_output=async_output, **options)

    def output_arena_bytes(self, spec: ModelSpec) -> int:
        """What the configured outputs can need at once: the largest output a
        request may ask for (``spec.largest_output_bytes``) for every request
        of a batch and every output the workers' output threads may still
        hold, in whole MiB. The arena is the smaller of this and
        ``max_pending_output_bytes``, so a small model does not page-lock
        (and count against a container's memory) 2 GiB it can never fill."""
        outputs = self.scheduling.max_num_seqs + self.executor.output_queue_depth
        need = spec.largest_output_bytes() * outputs
        return max(4096, -(-need // (1 << 20)) * (1 << 20))

    def _check_devices(self, platform: Platform) -> None:
        """One device per rank on an accelerator (two ranks on one device would
        fail in the first collective). The ray backend takes its devices from
        the cluster, which checks them itself."""
        if (platform.device_type == "cpu" or self.executor.executor_backend == "ray"
                or self.ranks == 1):
            return
        devices = platform.device_count()
        if self.ranks > devices:
            p = self.parallel
            field = next(n for n in ("ulysses_degree", "ring_degree", "cfg_parallel_size")
                         if getattr(p, n) > 1)
            raise EngineConfigError(field, (
                f"cfg_parallel_size x ulysses_degree x ring_degree = {self.ranks} ranks, one "
                f"device each, but {devices} {platform.device_type} device(s) are visible"))

    # -- checks across fields ---------------------------------------------------------------------
    def _check_combinations(self) -> None:
        """What no single declaration can say: the parallel degrees' product,
        the decode options, the slo settings, the executor that runs the ranks."""
        p, ranks = self.parallel, self.parallel.ranks
        if p.world_size is not None and p.world_size != ranks:
            raise EngineConfigError("world_size", (
                f"{p.world_size} ranks, but cfg_parallel_size x ulysses_degree x ring_degree "
                f"= {p.cfg_parallel_size} x {p.ulysses_degree} x {p.ring_degree} = "
                f"{ranks}; leave world_size unset (it is their product). Ranks that would "
                "each run the whole pipeline add nothing"))
        if p.vae_parallel and ranks == 1:
            raise EngineConfigError("vae_parallel", "splits the decode over the ranks that "
                                    "cfg_parallel_size, ulysses_degree or ring_degree give; "
                                    "with one rank there is nothing to split")
        if p.vae_parallel and self.model_config.vae_tiling:
            raise EngineConfigError("vae_parallel", "decodes in bands over the ranks; "
                                    "vae_tiling is the one-rank way to save decode memory: "
                                    "use one of them")
        sched, defaults = self.scheduling, SchedulingConfig()
        if sched.scheduling_policy != "slo":
            for name in ("refuse_unmeetable", "slo_aging_ticks", "max_paused_state_bytes"):
                if getattr(sched, name) != getattr(defaults, name):
                    raise EngineConfigError(name, "applies to scheduling_policy='slo' only, "
                                            f"not {sched.scheduling_policy!r}")
        m = self.model_config
        if m.offload == "layerwise" and m.quantization != "none":
            raise EngineConfigError("offload", (
                "layerwise offload packs each block's parameters into one copy; "
                f"quantization={m.quantization!r} replaces them per call (layerwise "
                "casting) or with tensor subclasses (torchao): use offload='model' with it"))
        if m.offload != "layerwise" and m.offload_prefetch != ModelConfig().offload_prefetch:
            raise EngineConfigError("offload_prefetch", "applies to offload='layerwise' only, "
                                    f"not {m.offload!r}")
        if m.offload != "none" and m.quantization == "fp8":
            raise EngineConfigError("offload", (
                "fp8's torchao conversion runs on the device, so the model loads there in "
                "full precision before any offload: use int8 or fp8-storage with offload"))
        if m.offload != "none":
            if m.compile:
                raise EngineConfigError("offload", f"{m.offload} offload re-points the "
                                        "transformer's parameters between calls, under which "
                                        "a compiled graph's guards fail: use compile or "
                                        "offload")
            if ranks != 1:
                raise EngineConfigError("offload", (
                    f"{m.offload} offload runs on one rank; {ranks} ranks each hold their "
                    "own copy of the weights (the parallel degrees split the work, not "
                    "them)"))
        if self.executor.executor_backend == "inproc" and ranks != 1:
            raise EngineConfigError("executor_backend", f"inproc runs exactly one rank; "
                                    f"{ranks} ranks need 'mp' or 'ray'")

    def _resolve_model(self) -> ModelSpec:
        from diffrt.engine.models.folder_check import ModelLoadError
        from diffrt.engine.models.registry import UnknownModelError, resolve_model_spec
        from diffrt.engine.setup_checks import check_saved_methods

        # The engine process resolves the model too (to check requests at
        # submission), so a plugin that registers it must be imported here as
        # well as in the workers.
        for name in self.model_config.plugin_modules:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise EngineConfigError("plugin_modules",
                                        f"cannot import {name!r}: {e}") from e
        try:
            spec = resolve_model_spec(self.model_config.model)
        except UnknownModelError as e:
            raise EngineConfigError("model", str(e)) from e
        except ModelLoadError as e:
            raise EngineConfigError("model", f"cannot load {self.model!r}: {e}") from e
        try:
            spec.check_parallel(self.parallel_degrees(), self.parallel.vae_parallel)
        except ParallelConfigError as e:
            raise EngineConfigError(e.field, str(e)) from e
        for name in ("quantization", "text_encoder_quantization"):
            method = getattr(self.model_config, name)
            if method != "none" and method not in spec.quantization:
                raise EngineConfigError(name, (
                    f"model {self.model!r} ({spec.family}) takes "
                    f"{', '.join(spec.quantization) or 'no lower-precision weights'}, "
                    f"not {method!r}"))
            if method in ("int8", "fp8"):
                from diffrt.engine.weights.quantize import TORCHAO_MISSING, torchao_available

                if not torchao_available():
                    raise EngineConfigError(name, TORCHAO_MISSING)
        check_saved_methods(self.model_config, spec)
        step_execution = self.scheduling.step_execution
        if step_execution and not spec.supports_step_execution:
            raise EngineConfigError(
                "step_execution",
                f"model {self.model!r} ({spec.family}) does not implement the step protocol",
            )
        if (not step_execution and self.scheduling.max_num_seqs > 1
                and not spec.supports_request_batch):
            raise EngineConfigError(
                "max_num_seqs",
                f"model {self.model!r} ({spec.family}) does not support request batching; "
                "use max_num_seqs=1 or step_execution=True",
            )
        return spec


__all__ = ["PIPELINE_RUNNER_CLS", "EngineConfig", "EngineConfigError", "ExecutionMode",
           "usable_methods"]


def _rebuild(settings: dict[str, object]) -> EngineConfig:
    return EngineConfig(**settings)
