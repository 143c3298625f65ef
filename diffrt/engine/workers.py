"""The engine's workers: the executor that runs them, built from the config
(after the dry run of their set-up, ``EngineConfig.executor_config``); what
their loaded weights hold; and the fresh, warm workers a restart swaps in.
"""

from __future__ import annotations

import logging

from diffrt.engine.config import EngineConfig, usable_methods
from diffrt.engine.errors import EngineConfigError
from diffrt.engine.input_images import release
from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.lora.registration import load_on_workers
from diffrt.engine.lora.registry import AdapterRegistry
from diffrt.engine.memory_estimate import value_bytes
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.runner_messages import CountWeights, ExecuteBatch, WeightBytes
from diffrt.engine.start_up import warmup_request
from diffrt.engine.submission import accept
from diffrt.engine.weights.budget import refusal, weight_settings
from diffrt.runtime.executor import Executor
from diffrt.runtime.factory import make_executor
from diffrt.runtime.input_arena import InputArena

logger = logging.getLogger(__name__)


def start_executor(config: EngineConfig, inputs: InputArena | None = None) -> Executor:
    """Workers for ``config`` on this process's platform (``inputs``: the
    input arena they share with the engine, kept across restarts)."""
    from diffrt.platforms import current_platform

    return make_executor(config.executor.executor_backend,
                         config.executor_config(platform=current_platform), inputs)


def count_weights(executor: Executor, config: EngineConfig, spec: ModelSpec) -> WeightBytes | None:
    """What the loaded weights hold, logged; past ``device_memory_budget`` the
    start fails naming what would fit. None: an executor that loads nothing
    (a test's own)."""
    replies = executor.collective_rpc(CountWeights())
    report = next((r for r in replies if isinstance(r, WeightBytes)), None)
    if report is None:
        return None
    logger.info("resident weights: %s", ", ".join(
        f"{name} ({report.methods.get(name, 'none')}) "
        + " + ".join(f"{n / 2**20:.1f} MiB {kind}" for kind, n in sorted(held.items()))
        for name, held in report.components.items()))
    logger.info("weights on the device at their peak: %.1f MiB%s", report.on_device / 2**20,
                "".join(f"; {name} offloaded ({n / 2**20:.1f} MiB in host memory)"
                        for name, n in report.offloaded.items()))
    from diffrt.platforms import current_platform

    model = config.model_config
    budget, on_device = model.device_memory_budget, report.on_device
    if budget is not None and on_device > budget:
        raise EngineConfigError("device_memory_budget", refusal(
            on_device, budget, spec.folder, value_bytes(model.dtype, current_platform),
            current=weight_settings(model), methods=usable_methods(spec, current_platform),
            host_is_device=current_platform.host_is_device, measured=True))
    return report


class FreshWorkers:
    """Builds the workers a restart swaps in, warmed up by one request run
    on them directly (its output is dropped) and given every registered
    adapter; called on the engine loop's thread (``restart.py``)."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, adapters: AdapterRegistry,
                 inputs: InputArena | None):
        self._config = config
        self._spec = spec
        self._adapters = adapters
        self._inputs = inputs
        #: the warm-up a restart's fresh workers run, accepted once now: an
        #: edit-only model's start-up picture then stays stored for the engine's
        #: life, so a restart finds it even when queued requests fill the arena
        self._warmup: DiffusionRequest | None = None
        if config.executor.restart_workers and inputs is not None:
            self._warmup = accept(warmup_request(spec), spec, config, None, inputs)

    def __call__(self) -> Executor:
        executor = start_executor(self._config, self._inputs)
        try:
            warmup = self._warmup or accept(warmup_request(self._spec), self._spec,
                                            self._config, None, self._inputs)
            try:
                out = executor.execute(ExecuteBatch(requests=[warmup]),
                                       timeout=self._config.model_config.warmup_timeout_s)
            finally:
                if warmup is not self._warmup:
                    release(warmup, self._inputs)
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
        for adapter in self._adapters.registered():
            try:
                load_on_workers(executor, adapter.id, adapter.path,
                                self._config.model_config.lora_load_timeout_s)
            except (AdapterFileError, TimeoutError) as exc:
                logger.error("LoRA adapter %r is gone after the restart: %s", adapter.name, exc)
                self._adapters.lost(adapter.id)

    def close(self) -> None:
        """The engine closes: the stored warm-up's input goes."""
        if self._warmup is not None and self._inputs is not None:
            release(self._warmup, self._inputs)


__all__ = ["FreshWorkers", "count_weights", "start_executor"]
