"""What a cached request keeps between its steps, and the bound on it.

A ``RequestCache`` lives in the request's worker state (``StepRequestState``)
and goes with it in every ending. A step's decision is *pending* until the
step is applied (``commit``, from ``apply_step``): a step batch that fails
and is retried request by request decides again from the same state.

Its tensors are counted against the worker's ``CacheBudget``
(``ModelConfig.cache_state_bytes``) when first stored; a request whose state
would not fit runs uncached from then on and says so in its metrics
(``uncached_reason``). The budget counts the live caches it admitted, so a
state that is dropped (finished, aborted, failed) stops counting with it.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch

from diffrt.engine.cache.policies import FIRST_BLOCK, TEACACHE, CachePlan, relative_l1, rescaled
from diffrt.engine.outputs import CacheMetrics

logger = logging.getLogger(__name__)

#: ``uncached_reason`` of a request whose state did not fit the bound
STATE_BOUND = "cache_state_bytes"
#: ``ModelConfig.cache_state_bytes``' default: 1 GiB of a worker's memory for
#: the residuals its cached requests keep
DEFAULT_CACHE_STATE_BYTES = 1 << 30


class CacheBudget:
    """The most bytes the live caches of one worker may hold."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._live: weakref.WeakSet[RequestCache] = weakref.WeakSet()

    def used(self) -> int:
        return sum(cache.nbytes for cache in list(self._live))

    def admit(self, cache: RequestCache, nbytes: int) -> bool:
        """Count ``nbytes`` more for ``cache`` when they fit."""
        if cache not in self._live and self.used() + nbytes > self.max_bytes:
            return False
        self._live.add(cache)
        return True


@dataclass
class _Pending:
    """One step's decision and what it would store, until the step is applied."""

    reused: bool
    metric: float | None
    reference: torch.Tensor | None
    residual: torch.Tensor | None = None
    #: what was compared with the threshold (TeaCache: the accumulated
    #: rescaled change; None: the metric itself), and what the request
    #: carries on to its next step
    compared: float | None = None
    accumulated: float = 0.0


class RequestCache:
    """One request's step cache: its plan, the tensors it compares and
    reuses, its decisions so far (``policies`` for the rules)."""

    def __init__(self, plan: CachePlan, total_steps: int, budget: CacheBudget,
                 request_id: str = ""):
        self.plan = plan
        self.total_steps = total_steps
        self.budget = budget
        self.request_id = request_id
        #: denoise steps applied so far (the index of the next decision)
        self.step = 0
        #: first-block: the head block's residual of the last computed step;
        #: teacache: the previous step's modulated input
        self.reference: torch.Tensor | None = None
        #: the skipped blocks' residual from the last computed step
        self.residual: torch.Tensor | None = None
        self.accumulated = 0.0
        self.reused_steps: list[int] = []
        self.uncached_reason: str | None = None
        self.pending: _Pending | None = None

    @property
    def active(self) -> bool:
        """It still caches (it ran into no bound)."""
        return self.uncached_reason is None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.reference, self.residual)
                   if t is not None)

    # -- decisions (during the transformer call) --------------------------------------
    def decide_first_block(self, head_residual: torch.Tensor) -> bool:
        """First-Block Cache: reuse when the head block's residual moved less
        than the threshold since the last computed step."""
        metric = None if self.reference is None or self.residual is None else relative_l1(
            head_residual, self.reference)
        reused = metric is not None and metric < self.plan.threshold
        self.pending = _Pending(reused, metric, None if reused else head_residual)
        return reused

    def decide_teacache(self, modulated: torch.Tensor) -> bool:
        """TeaCache: reuse while the accumulated rescaled change of the
        modulated input stays below the threshold; the first and last steps
        compute."""
        last = self.step >= self.total_steps - 1
        metric = compared = None
        reused = False
        if self.reference is not None and self.residual is not None and not last:
            metric = relative_l1(modulated, self.reference)
            compared = self.accumulated + rescaled(metric, self.plan.rescale)
            reused = math.isfinite(compared) and compared < self.plan.threshold
        self.pending = _Pending(reused, metric, modulated, compared=compared,
                                accumulated=compared if reused and compared is not None else 0.0)
        return reused

    def computed_residual(self, residual: torch.Tensor) -> None:
        """The residual of the blocks a computed step ran, kept for reuse."""
        assert self.pending is not None and not self.pending.reused
        self.pending.residual = residual

    # -- after the step -------------------------------------------------------------------
    def commit(self) -> None:
        """The pending decision becomes the request's (its step was applied)."""
        pending, self.pending = self.pending, None
        step = self.step
        self.step += 1
        if pending is None or not self.active:  # it ran uncached
            return
        margin = ""
        if pending.metric is not None:
            compared = pending.metric if pending.compared is None else pending.compared
            summed = "" if pending.compared is None else f", accumulated rescaled {compared:.6g}"
            margin = (f" metric {pending.metric:.6g}{summed} (threshold {self.plan.threshold:g}, "
                      f"margin {compared - self.plan.threshold:+.3g})")
        logger.debug("request %s step %d: %s %s%s", self.request_id, step, self.plan.policy,
                     "reused" if pending.reused else "computed", margin)
        if pending.reused:
            self.reused_steps.append(step)
            if self.plan.policy == TEACACHE:
                self.reference, self.accumulated = pending.reference, pending.accumulated
            return
        new_bytes = sum(t.numel() * t.element_size() for t in (pending.reference, pending.residual)
                        if t is not None)
        if self.nbytes == 0 and not self.budget.admit(self, new_bytes):
            logger.info("request %s runs uncached: its cache state (%d bytes) does not fit "
                        "cache_state_bytes (%d bytes, %d in use)", self.request_id, new_bytes,
                        self.budget.max_bytes, self.budget.used())
            self.uncached_reason = STATE_BOUND
            self.free()
            return
        self.reference, self.residual = pending.reference, pending.residual
        self.accumulated = pending.accumulated

    def free(self) -> None:
        """Drop its tensors (the request ended, or the bound stopped it)."""
        self.reference = self.residual = None
        self.pending = None

    def metrics(self) -> CacheMetrics:
        return CacheMetrics(policy=self.plan.policy, threshold=self.plan.threshold,
                            steps_computed=self.step - len(self.reused_steps),
                            steps_reused=len(self.reused_steps),
                            reused_steps=list(self.reused_steps),
                            uncached_reason=self.uncached_reason)


__all__ = ["DEFAULT_CACHE_STATE_BYTES", "FIRST_BLOCK", "STATE_BOUND", "TEACACHE", "CacheBudget",
           "RequestCache"]
