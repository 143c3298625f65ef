"""The worker's set-up as one plan: the features applied to a loaded pipeline,
in one declared order.

``PipelineRunner`` loads the pipeline (into host memory first when its
weights are converted or offloaded: ``loads_on_host``) and then applies
``PLAN``, step by step. Each step is an applier taking the pipeline, its
settings group (``ModelConfig`` or ``ParallelConfig``), the platform and the
worker's place (its device, the model, the handles of the steps before it),
and returning a handle the runner keeps (the offloads, the adapter loader;
None where the step leaves nothing to hold). The order is the data below,
and it is an order of necessity:

1. ``mixed_rows``: how rows of different sizes share a step (read by the
   calls the later steps hook).
2. ``weights``: convert the weights first — the offloads, the parallel
   split, LoRA and compile all see the quantised linears.
3. ``offload`` then ``model_offload``: take the blocks, then whole
   components, to host memory, copying to the worker's device (where the
   pipeline computes once placed).
4. ``placement``: a model loaded into host memory first moves what stays
   on the device there (not what the model offload manages).
5. ``memory``: the decode's tiling and slicing.
6. ``parallel``: every rank builds the same groups, in the same order.
7. ``lora``: after the parallel hooks, on the eager model.
8. ``compile``: after the parallel and LoRA hooks — they patch the model
   it traces.
9. ``prompt_cache``, ``cache_budget``, ``step_hook``: what the requests
   use, set last.

A step may pair with a check (``setup_checks``): ``dry_run`` runs those in
the engine process before any worker starts, so a setting the model or the
platform refuses fails there, naming the field, not in a worker's load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from diffrt.engine import setup_checks
from diffrt.engine.cache.state import CacheBudget
from diffrt.engine.lora import adapter_file
from diffrt.engine.lora.loader import AdapterLoader
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.parallel.degrees import ParallelDegrees
from diffrt.engine.pipelines.interface import DiffusionPipeline
from diffrt.engine.pipelines.segments import resolve_mixed_rows
from diffrt.engine.runner_messages import RunnerSettings
from diffrt.engine.settings import ModelConfig, ParallelConfig
from diffrt.engine.weights.prequantized import folder_methods

if TYPE_CHECKING:
    from diffrt.engine.weights.model_offload import ModelOffload
    from diffrt.engine.weights.offload import LayerwiseOffload
    from diffrt.platforms.interface import Platform

G = TypeVar("G", ModelConfig, ParallelConfig)


@dataclass
class Handles:
    """What the steps of the plan leave for the runner, by step name (a step
    that leaves nothing has no field)."""

    #: how rows of different sizes share a step, resolved for the platform
    mixed_rows: str = "padded"
    #: the weight method each component runs with
    weights: dict[str, str] = field(default_factory=dict)
    #: offload="layerwise": the blocks' host copies and device slots
    offload: LayerwiseOffload | None = None
    #: offload="model" (every component) or offload_text_encoders (those only)
    model_offload: ModelOffload | None = None
    #: several ranks share each request
    parallel: bool = False
    #: LoRA adapter files read on a thread of their own (None: the model takes none)
    lora: AdapterLoader | None = None
    #: the bound on the step caches' state
    cache_budget: CacheBudget = field(default_factory=lambda: CacheBudget(0))


@dataclass
class WorkerPlace:
    """Where the plan applies: the worker's device, its model, and what the
    steps applied so far left (``handles``, by step name)."""

    device: torch.device
    spec: ModelSpec
    #: the weights loaded into host memory first (``loads_on_host``)
    host_first: bool
    #: progress from inside a forward (the runner's heartbeat, read late:
    #: the runtime's worker replaces it after the set-up)
    heartbeat: Callable[[], None]
    #: waits for the text encoder's stream (the prompt cache's timing)
    synchronize: Callable[[], None]
    handles: Handles = field(default_factory=Handles)


@dataclass(frozen=True)
class SetUpStep(Generic[G]):
    """One step of the plan: its name (the key of its handle), the settings
    group it reads, what it does, and what its dry run refuses."""

    name: str
    group: Callable[[RunnerSettings], G]
    apply: Callable[[DiffusionPipeline, G, Platform, WorkerPlace], object]
    check: Callable[[G, ModelSpec, Platform], None] | None = None


def _model(settings: RunnerSettings) -> ModelConfig:
    return settings.model


def _parallel(settings: RunnerSettings) -> ParallelConfig:
    return settings.parallel


# -- the appliers ------------------------------------------------------------------------
def use_mixed_rows(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                   place: WorkerPlace) -> str:
    arrangement = resolve_mixed_rows(m.mixed_rows, platform)
    pipeline.use_mixed_rows(arrangement)
    return arrangement


def convert_weights(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                    place: WorkerPlace) -> dict[str, str]:
    """Convert (``quantization``); the handle: the method each component
    runs with — as configured, or as the folder saved it (a second
    transformer, Wan 2.2's low-noise expert, converted as the first)."""
    if m.quantization != "none" or m.text_encoder_quantization != "none":
        pipeline.quantize_weights(m.quantization, m.text_encoder_quantization)
    saved = folder_methods(place.spec.folder) if place.spec.folder else {}
    return {name: saved.get(name) or (
        m.quantization if name.startswith("transformer") else m.text_encoder_quantization
        if name.startswith("text_encoder") else "none")
        for name in pipeline.weight_modules()}


def offload_layers(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                   place: WorkerPlace) -> LayerwiseOffload | None:
    """``offload="layerwise"``: the blocks' host copies and device slots."""
    if m.offload != "layerwise":
        return None
    return pipeline.enable_layerwise_offload(platform, m.offload_prefetch, device=place.device)


def offload_models(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                   place: WorkerPlace) -> ModelOffload | None:
    """``offload="model"`` (every component) or ``offload_text_encoders`` (those only)."""
    texts = [n for n in pipeline.weight_modules() if n.startswith("text_encoder")]
    if not (m.offload == "model" or (m.offload_text_encoders and texts
                                     and not platform.host_is_device)):
        return None
    return pipeline.enable_model_offload(
        platform, kept=() if m.offload == "model" else tuple(
            n for n in pipeline.weight_modules() if not n.startswith("text_encoder")),
        device=place.device)


def place_weights(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                  place: WorkerPlace) -> None:
    """A model loaded into host memory first: what stays on the device goes there."""
    if not place.host_first:
        return
    offload = place.handles.model_offload
    pipeline.place_weights(place.device, on_host=tuple(
        offload.managed) if offload is not None else ())


def configure_memory(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                     place: WorkerPlace) -> None:
    pipeline.configure_memory(vae_tiling=m.vae_tiling, vae_slicing=m.vae_slicing)


def split_over_ranks(pipeline: DiffusionPipeline, p: ParallelConfig, platform: Platform,
                     place: WorkerPlace) -> bool:
    """The parallel degrees' groups; the handle: whether ranks share each request."""
    degrees = ParallelDegrees(cfg=p.cfg_parallel_size, ulysses=p.ulysses_degree,
                              ring=p.ring_degree)
    if degrees.world_size <= 1:
        return False
    from diffrt.engine.parallel.groups import build_groups

    pipeline.enable_parallel(build_groups(degrees), vae_parallel=p.vae_parallel)
    return True


def enable_adapters(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                    place: WorkerPlace) -> AdapterLoader | None:
    """LoRA slots; the handle: the loader that reads adapter files on a
    thread of its own (None: the model takes none)."""
    spec = place.spec
    family_class = spec.diffusers_pipeline
    if not spec.lora_target_modules or family_class is None:
        return None
    linears = pipeline.enable_loras(m.max_loras)
    targets = spec.lora_target_modules
    return AdapterLoader(lambda path: adapter_file.read_adapter(
        path, family_class, linears, targets))


def compile_models(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                   place: WorkerPlace) -> None:
    if m.compile:
        pipeline.compile_models(m.compile_backend)


def cache_prompts(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                  place: WorkerPlace) -> None:
    pipeline.enable_prompt_cache(m.prompt_cache_bytes, synchronize=place.synchronize)


def bound_step_caches(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
                      place: WorkerPlace) -> CacheBudget:
    budget = CacheBudget(m.cache_state_bytes)
    pipeline.use_cache_budget(budget)
    return budget


def hook_steps(pipeline: DiffusionPipeline, m: ModelConfig, platform: Platform,
               place: WorkerPlace) -> None:
    """Progress from inside a forward reaches the executor's watchdog."""
    heartbeat = place.heartbeat
    pipeline.use_step_hook(lambda: heartbeat())


#: the plan, in the order the module docstring gives its reasons for
PLAN: tuple[SetUpStep[Any], ...] = (
    SetUpStep("mixed_rows", _model, use_mixed_rows),
    SetUpStep("weights", _model, convert_weights, setup_checks.check_weights),
    SetUpStep("offload", _model, offload_layers, setup_checks.check_offload),
    SetUpStep("model_offload", _model, offload_models),
    SetUpStep("placement", _model, place_weights),
    SetUpStep("memory", _model, configure_memory, setup_checks.check_memory),
    SetUpStep("parallel", _parallel, split_over_ranks),
    SetUpStep("lora", _model, enable_adapters),
    SetUpStep("compile", _model, compile_models),
    SetUpStep("prompt_cache", _model, cache_prompts),
    SetUpStep("cache_budget", _model, bound_step_caches),
    SetUpStep("step_hook", _model, hook_steps),
)


def apply_plan(pipeline: DiffusionPipeline, settings: RunnerSettings, platform: Platform,
               place: WorkerPlace) -> Handles:
    """Apply every step in order; what they left (``Handles``)."""
    for step in PLAN:
        handle = step.apply(pipeline, step.group(settings), platform, place)
        if handle is not None:
            setattr(place.handles, step.name, handle)
    return place.handles


def dry_run(settings: RunnerSettings, platform: Platform) -> None:
    """Every step's check, in the plan's order (``EngineConfigError`` naming
    the field of the first that refuses); nothing is loaded."""
    for step in PLAN:
        if step.check is not None:
            step.check(step.group(settings), settings.spec, platform)


def loads_on_host(model: ModelConfig, platform: Platform) -> bool:
    """Whether the weights load into host memory first, to be converted
    (``fp8-storage``, ``int8``) or offloaded before what stays on the device
    moves there: the full-precision model need not fit the device. ``fp8``'s
    torchao conversion runs on the device, so it loads there."""
    if platform.host_is_device or model.quantization == "fp8":
        return False
    return (model.quantization != "none" or model.text_encoder_quantization != "none"
            or model.offload != "none" or model.offload_text_encoders)


__all__ = ["PLAN", "Handles", "SetUpStep", "WorkerPlace", "apply_plan", "dry_run", "loads_on_host"]
