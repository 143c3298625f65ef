"""What a trainer asks of a running engine between rollouts (docs/rollouts.md):
weight updates of the transformer and of LoRA adapters, versioned; sleep and
wake. A part of
``DiffusionEngine`` (its base), kept apart so the facade stays small.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

import torch

from diffrt.engine.between_ticks import BetweenTicks
from diffrt.engine.lora.control import LoraControl
from diffrt.engine.lora.registration import update
from diffrt.engine.lora.registry import AdapterRegistry, LoraInfo
from diffrt.engine.runner_messages import (
    ForgetPreviousWeights,
    SleepReport,
    SleepWorkers,
    WakeWorkers,
)
from diffrt.engine.weight_sync import (
    SHARED_PREFIX,
    StagedSource,
    Version,
    WeightSource,
    WeightsUpdate,
    apply_update,
    next_version,
    revert_update,
    shared_dir,
    write_tensors,
)
from diffrt.engine.weights.update import WeightUpdateError, safetensors_files

if TYPE_CHECKING:
    from diffrt.engine.config import EngineConfig
    from diffrt.engine.core import EngineCore
    from diffrt.engine.output_processor import OutputProcessor
    from diffrt.runtime.executor import Executor

logger = logging.getLogger(__name__)

#: what happens to the requests running when an update arrives: "wait" —
#: they finish on the weights they started with, then the update applies;
#: "abort" — they are aborted at the next step boundary
UpdatePolicy = Literal["wait", "abort"]
#: the file an updated adapter's factors are written to (diffusers' name)
LORA_FILE = "pytorch_lora_weights.safetensors"


class RolloutControl(LoraControl):
    """Weight updates for ``DiffusionEngine`` (see the module)."""

    config: EngineConfig
    adapters: AdapterRegistry
    output_processor: OutputProcessor
    _core: EngineCore
    #: the version ``revert_weights`` goes back to (an update kept the previous weights)
    _previous_version: Version | None = None

    def abort(self, request_id: str) -> None: ...

    @property
    def weights_version(self) -> Version:
        """The transformer weights' version new requests run on (0 as
        loaded; every output carries the one it ran on)."""
        return self._core.weights_version

    def update_weights(self, source: WeightSource, *, version: Version | None = None,
                       policy: UpdatePolicy = "wait", timeout: float | None = None) -> Version:
        """Replace (some of) the transformer's weights; returns the new version.

        ``source``: a safetensors file, a folder of them (a diffusers
        ``transformer/`` folder), or a mapping of the transformer's parameter
        names to tensors (written to shared memory for the workers). Applied
        between two ticks once no request runs: with ``policy="wait"`` the
        running requests finish on the weights they started with (new ones
        wait meanwhile), with ``"abort"`` they are aborted. Every rank
        reports a checksum of what it read; one that differs from the
        source's refuses the update (``WeightsMismatchError``) and the old
        weights stay. ``version``: the new version's name (default: the
        current one plus one). ``WeightUpdateError`` for a source this model
        cannot take (unknown names, other shapes); ``TimeoutError`` when it
        was not applied within ``timeout`` seconds (it may still apply).
        """
        return self.update_weights_report(source, version=version, policy=policy,
                                          timeout=timeout).version

    def update_weights_report(self, source: WeightSource, *, version: Version | None = None,
                              policy: UpdatePolicy = "wait", timeout: float | None = None,
                              keep_previous: bool = False) -> WeightsUpdate:
        """``update_weights``, answering the checksums beside the version
        (the source's and each rank's: what ``POST /v1/weights`` shows).
        ``keep_previous``: every rank keeps a host copy of the values it
        replaced, for ``revert_weights`` (until ``forget_previous_weights``
        or the next update), at the cost of that host memory."""
        if policy not in ("wait", "abort"):
            raise WeightUpdateError(f"policy must be 'wait' or 'abort', got {policy!r}")
        self._check_plain_weights("update_weights")
        new = next_version(self._core.weights_version, version)
        staged = StagedSource(source)
        try:
            def work(executor: Executor) -> WeightsUpdate:
                ranks = apply_update(executor, staged, keep_previous)
                self._previous_version = self._core.weights_version if keep_previous else None
                self._core.weights_version = new
                return WeightsUpdate(version=new, checksum=staged.checksum,
                                     rank_checksums=ranks)

            job = BetweenTicks(work, drain=True, what="update_weights")
            self._core.between_ticks(job)
            if policy == "abort":
                ids = self._core.running(self.output_processor.active_ids())
                for rid in ids:
                    self.abort(rid)
            applied: WeightsUpdate = job.future.result(timeout)
        finally:
            staged.remove()
        logger.info("transformer weights updated to version %r (%s)", applied.version,
                    staged.checksum)
        return applied

    def revert_weights(self, *, timeout: float | None = None) -> Version:
        """Put back the weights the last ``update_weights_report(...,
        keep_previous=True)`` replaced, and their version; returns it. What a
        Ray Serve replica does when an update reached only some replicas
        (``serve/ray_weights.py``). A draining job between ticks, as the
        update was (the running requests finish first). ``WeightUpdateError``
        when nothing is kept: no such update, another one since, a level-2
        sleep, or fresh workers after a restart."""
        def work(executor: Executor) -> Version:
            previous = self._previous_version
            if previous is None:
                raise WeightUpdateError("no previous weights are kept to roll back to")
            revert_update(executor)
            self._previous_version = None
            self._core.weights_version = previous
            return previous

        job = BetweenTicks(work, drain=True, what="revert_weights")
        self._core.between_ticks(job)
        version: Version = job.future.result(timeout)
        logger.info("transformer weights rolled back to version %r", version)
        return version

    def forget_previous_weights(self, *, timeout: float | None = None) -> None:
        """Drop the copy ``keep_previous`` kept (the update is settled)."""
        def work(executor: Executor) -> None:
            executor.collective_rpc(ForgetPreviousWeights())
            self._previous_version = None

        job = BetweenTicks(work, drain=False, what="forget_previous_weights")
        self._core.between_ticks(job)
        job.future.result(timeout)

    @property
    def sleeping(self) -> bool:
        """The workers sleep (``sleep``): requests wait until ``wake``."""
        return self._core.jobs.asleep

    def sleep(self, level: int = 1, *, timeout: float | None = None) -> SleepReport:
        """Put the workers' weights away once the running requests finish
        (new ones wait meanwhile, and until ``wake``): level 1 moves every
        component's weights to page-locked host memory and gives the
        device's cache back; level 2 also drops the transformer's weights
        (``wake`` reads them from the model's folder again: version 0).
        Returns rank 0's counts (``SleepReport``: bytes freed on the device).
        On the CPU, whose device is the host, it frees nothing: accepted, a
        no-op for memory (requests still wait until ``wake``)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_plain_weights("sleep")

        def work(executor: Executor) -> SleepReport:
            replies = executor.collective_rpc(SleepWorkers(level))
            self._core.jobs.asleep = True
            return replies[0]

        return self._between_ticks(work, drain=True, what="sleep", timeout=timeout)

    def wake(self, *, timeout: float | None = None) -> SleepReport:
        """Bring the weights back (bit for bit, or from the folder after a
        level-2 sleep) and admit the waiting requests again."""
        def work(executor: Executor) -> SleepReport:
            replies = executor.collective_rpc(WakeWorkers())
            if replies[0].reloaded:
                self._core.weights_version = 0
            self._core.jobs.asleep = False
            return replies[0]

        return self._between_ticks(work, drain=False, what="wake", timeout=timeout)

    def _between_ticks(self, work: Callable[[Executor], SleepReport], *, drain: bool,
                       what: str, timeout: float | None) -> SleepReport:
        job = BetweenTicks(work, drain=drain, what=what)
        self._core.between_ticks(job)
        report: SleepReport = job.future.result(timeout)
        return report

    def _check_plain_weights(self, what: str) -> None:
        """Weight updates and sleep work on the parameters as loaded."""
        model = self.config.model_config
        if model.quantization != "none" or model.offload != "none":
            raise WeightUpdateError(
                f"{what} works on the transformer's parameters as loaded: not with "
                f"quantization={model.quantization!r} or offload={model.offload!r}")

    def update_lora(self, name: str, source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
                    *, version: Version | None = None) -> LoraInfo:
        """New factors for the registered adapter ``name``, as registering
        them would give (a mapping is written beside the adapter's LoRA
        metadata, its ranks and alphas, from its current file). Requests
        accepted from now on run with them; those accepted before keep the
        old ones until they end. Returns its info, with the new ``version``
        (default: the current one plus one); outputs carry it in
        ``lora_versions``."""
        current = next((a for a in self.adapters.infos() if a.name == name), None)
        if current is None:
            raise KeyError(f"no LoRA adapter named {name!r}")
        new = next_version(current.version, version)
        path = os.fspath(source) if not isinstance(source, Mapping) else shared_dir()
        try:
            if isinstance(source, Mapping):
                write_tensors(source, path, LORA_FILE, _metadata(current.path))
            timeout = self.config.model_config.lora_load_timeout_s
            info = update(self.adapters, lambda: self._core.executor, name, path, new, timeout)
        except BaseException:
            _remove_own(path, source)
            raise
        # the file stays while the adapter has it (fresh workers after a
        # restart read it again); the version it replaced goes
        _remove_own(current.path)
        return info

    def remove_update_files(self) -> None:
        """At close: the shared-memory files of the adapters ``update_lora`` wrote."""
        for info in self.adapters.infos():
            _remove_own(info.path)


def _remove_own(path: str, source: object = None) -> None:
    """Remove ``path`` when it is a folder ``update_lora`` wrote (never a caller's)."""
    if source is None or isinstance(source, Mapping):
        if os.path.basename(path).startswith(SHARED_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


def _metadata(path: str) -> dict[str, str] | None:
    """The safetensors metadata of an adapter's file (PEFT's LoRA config)."""
    from safetensors import safe_open

    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        return f.metadata()


__all__ = ["RolloutControl", "UpdatePolicy"]
