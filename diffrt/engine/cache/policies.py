"""The step-cache policies: their names, defaults and per-step decisions.

Each decision is over one request's rows of one transformer call, and is a
pure function of tensors and the request's previous state, so a request
decides the same alone and in any batch (up to the floating-point noise of
batched matmuls, which moves the metric, not the rule).

* **first-block** (First-Block Cache, as diffusers' ``FirstBlockCacheConfig``
  and ParaAttention define it): run the first block; its residual (output
  minus input, image stream) is compared with the residual of the last step
  that ran every block, as ``mean|r - r_prev| / mean|r_prev|``; below the
  threshold the remaining blocks are skipped and their residual from that
  step added instead.
* **teacache** (TeaCache, Liu et al. 2024): the first block's
  timestep-modulated input is compared with the previous step's (relative L1
  distance), rescaled by the checkpoint's fitted polynomial and accumulated
  over steps; while the sum stays below the threshold every block is
  skipped and the whole stack's residual from the last computed step added.
  The first and the last step always compute (TeaCache's reference rule).

A step reuses only when its metric is strictly below the threshold, so a
threshold of 0 reuses nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FIRST_BLOCK = "first-block"
TEACACHE = "teacache"
POLICIES = (FIRST_BLOCK, TEACACHE)

#: the thresholds a policy takes when neither the request nor the model
#: names one: First-Block Cache's is diffusers' documented example
#: (``FirstBlockCacheConfig(threshold=0.2)`` ... 0.05 its default: too
#: cautious to skip anything on 12-step models), TeaCache's its FLUX
#: reference's "1.5x" setting
DEFAULT_THRESHOLDS = {FIRST_BLOCK: 0.1, TEACACHE: 0.25}


@dataclass(frozen=True)
class CachePlan:
    """What one request's cache does: its policy and threshold, and (TeaCache)
    the rescaling polynomial's coefficients, highest power first
    (``numpy.polyval``'s order; () leaves the distance as it is)."""

    policy: str
    threshold: float
    rescale: tuple[float, ...] = ()


def rescaled(distance: float, coefficients: tuple[float, ...]) -> float:
    """TeaCache's polynomial rescaling of a relative distance (Horner), never
    below 0: a fit can dip below zero outside the range it was fitted on,
    and a change never takes from what the steps before accumulated."""
    if not coefficients:
        return distance
    value = 0.0
    for c in coefficients:
        value = value * distance + c
    return max(0.0, value)


def relative_l1(now: torch.Tensor, before: torch.Tensor) -> float:
    """``mean|now - before| / mean|before|`` in float32 (both policies' metric);
    inf when ``before`` is all zeros (nothing to compare with: compute). One
    value to the host: the decision is made there."""
    now, before = now.float(), before.float()
    value = ((now - before).abs().mean() / before.abs().mean()).item()
    return value if math.isfinite(value) else math.inf
