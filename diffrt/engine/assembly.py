"""The engine's scheduler, its batch memory model and its step-cost model,
built from the config and the model's spec (``DiffusionEngine`` builds them
once, at its start)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from diffrt.engine import cost_store
from diffrt.engine.config import EngineConfig, ExecutionMode
from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.memory_estimate import (
    DEFAULT_DEVICE_SHARE,
    DEFAULT_HOST_SHARE,
    MemoryModel,
    default_batch_memory_budget,
    value_bytes,
)
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.pipelines.segments import resolve_mixed_rows
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.sched import RequestScheduler, Scheduler, StepScheduler, make_policy
from diffrt.engine.sched.share import ShareDecider

logger = logging.getLogger(__name__)


def make_scheduler(config: EngineConfig, spec: ModelSpec, run_time: RunTimeModel,
                   memory: MemoryModel | None, adapters: AdapterRegistry) -> Scheduler:
    """The mode's scheduler with the configured policy; the run-time model
    prices the ``slo`` policy's remaining work."""
    from diffrt.platforms import current_platform

    c = config.scheduling
    policy = make_policy(c.scheduling_policy, max_bypass=c.scheduling_max_bypass,
                         aging_ticks=c.slo_aging_ticks, cost=run_time)
    if config.mode is ExecutionMode.STEP_BATCH:
        key = step_batch_key(config, spec)
        rows = resolve_mixed_rows(config.model_config.mixed_rows, current_platform)
        share = None
        # ``!=``: a bound method is a new object at each access, equal to
        # another of the same function and instance
        if c.share_steps == "cost" and key != spec.step_batch_key:
            # kinds: what one call shares (size, adapters, step cache)
            share = ShareDecider(run_time, _kind(spec), max_bypass=c.scheduling_max_bypass,
                                 urgency=policy.urgency, protect_batch=rows == "by_size")
        return StepScheduler(c.max_num_seqs, policy,
                             max_wait_s=_seconds(c.step_batch_max_wait_ms),
                             key=key, share=share,
                             max_steps_per_tick=c.max_steps_per_tick, memory=memory,
                             tokens=lambda r: (spec.rows(r), spec.row_tokens(r)),
                             token_budget=c.max_num_batched_tokens or None,
                             padded=rows == "padded",
                             adapters=adapters, max_paused_bytes=c.max_paused_state_bytes)
    wait_ms = c.request_batch_max_wait_ms if spec.supports_request_batch else 0.0
    return RequestScheduler(c.max_num_seqs, policy, max_wait_s=_seconds(wait_ms),
                            key=spec.request_batch_key, memory=memory, adapters=adapters)


def run_time_model(config: EngineConfig, spec: ModelSpec) -> tuple[RunTimeModel, str]:
    """The step-cost model, seeded from what an earlier run of the same model,
    device, dtype and cost-changing settings persisted, and its store key."""
    from diffrt.platforms import current_platform

    m, p = config.model_config, config.parallel
    arrangement = resolve_mixed_rows(m.mixed_rows, current_platform)
    try:
        device = current_platform.device_name(0)
    except Exception:  # a platform that cannot name its device: its type
        device = current_platform.device_type
    settings = {
        "mode": config.mode.name, "arrangement": arrangement, "compile": m.compile,
        "compile_backend": m.compile_backend, "quantization": m.quantization,
        "batch_invariant": m.batch_invariant,
        "offload": m.offload, "vae_tiling": m.vae_tiling, "torch_threads": m.torch_threads,
        "plugin_modules": m.plugin_modules,
        "degrees": (p.cfg_parallel_size, p.ulysses_degree, p.ring_degree, p.world_size),
        "vae_parallel": p.vae_parallel,
    }
    key = cost_store.store_key(f"{current_platform.device_type}:{device}", spec.folder,
                               str(m.dtype), settings)
    steps = (config.scheduling.max_steps_per_tick if config.mode is ExecutionMode.STEP_BATCH
             else 1 << 30)  # a request-batch call runs every step of its requests
    model = RunTimeModel(spec, arrangement=arrangement, steps_per_tick=steps,
                         persisted=cost_store.load(key))
    return model, key


def save_step_costs(run_time: RunTimeModel, key: str, model_name: str) -> None:
    """Persist the step-cost model under ``key`` (``cost_store``; never
    raises), once it has been fitted."""
    if run_time.calibrated:
        cost_store.save(key, run_time.models(),
                        {"model": model_name, "error": run_time.online.error()})


def cost_stats(run_time: RunTimeModel, scheduler: Scheduler) -> dict[str, Any]:
    """``EngineStats``' step-cost fields: the online and idle coefficients,
    the recent prediction error and the share/split counts."""
    share = getattr(scheduler, "share", None)
    return {"step_cost": run_time.coefficients or {},
            "step_cost_idle": dict(run_time.idle or {}),
            "step_cost_error": run_time.online.error(),
            "steps_shared_total": share.shared if share is not None else 0,
            "steps_split_total": share.split if share is not None else 0}


def _kind(spec: ModelSpec) -> Callable[[DiffusionRequest], tuple]:
    """What makes two requests' rows different kinds of work in a step: their
    size (the model's own key), their adapters, their step cache."""
    def kind(request: DiffusionRequest) -> tuple:
        params = request.sampling_params
        return (spec.step_batch_key(request), tuple(sorted((params.loras or {}).items())),
                params.cache)
    return kind


def step_batch_key(config: EngineConfig, spec: ModelSpec) -> Callable[[DiffusionRequest], tuple]:
    """Sizes share a step when the setting, the model and the split allow
    (``mixed_size_batching``; a sequence-parallel split shards one size's
    tokens, so there the size stays in the key)."""
    if not (config.scheduling.mixed_size_batching and spec.mixed_sizes):
        return spec.step_batch_key
    p = config.parallel
    if p.ulysses_degree * p.ring_degree > 1:
        logger.info("mixed_size_batching: off with ulysses_degree=%d ring_degree=%d "
                    "(a sequence split needs one size per step)",
                    p.ulysses_degree, p.ring_degree)
        return spec.step_batch_key
    return spec.mixed_step_batch_key


def memory_model(config: EngineConfig, spec: ModelSpec) -> MemoryModel | None:
    """A request's estimated peak memory and the batch budget
    (``max_batch_memory_bytes``, or a share of the memory the workers
    report free; see ``engine/memory_estimate.py``); None with one request
    per batch: nothing to bound."""
    from diffrt.platforms import current_platform

    if config.scheduling.max_num_seqs == 1:
        return None
    budget = config.scheduling.max_batch_memory_bytes
    on_cpu = current_platform.device_type == "cpu"
    model = MemoryModel(
        spec, value_bytes(config.model_config.dtype, current_platform),
        budget=budget if budget is not None else default_batch_memory_budget(current_platform),
        explicit=budget is not None,
        share=DEFAULT_HOST_SHARE if on_cpu else DEFAULT_DEVICE_SHARE)
    if model.budget is not None:
        logger.info("batch memory budget %d MiB of estimated peak activations",
                    model.budget >> 20)
    return model


def _seconds(ms: float | None) -> float | None:
    """A window in ms as seconds; None (automatic) stays None."""
    return None if ms is None else ms / 1000.0


__all__ = ["cost_stats", "make_scheduler", "memory_model", "run_time_model", "save_step_costs",
           "step_batch_key"]
