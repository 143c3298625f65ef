"""The step-cache rules without a model (``engine.cache``): when each policy
reuses, what it keeps, that a decision becomes the request's only when its
step is applied, and the bound on what the caches hold."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from diffrt.engine.cache.policies import FIRST_BLOCK, TEACACHE, CachePlan, relative_l1, rescaled
from diffrt.engine.cache.state import STATE_BOUND, CacheBudget, RequestCache


def cache(policy: str, threshold: float, steps: int = 10, budget: CacheBudget | None = None,
          rescale: tuple[float, ...] = ()) -> RequestCache:
    return RequestCache(CachePlan(policy, threshold, rescale), steps,
                        budget or CacheBudget(1 << 20))


def filled(value: float) -> torch.Tensor:
    return torch.full((2, 4, 3), value)


def test_first_block_reuses_below_its_threshold_against_the_last_computed_step():
    c = cache(FIRST_BLOCK, 0.15)
    assert not c.decide_first_block(filled(1.0))  # nothing to compare with: compute
    c.computed_residual(filled(5.0))
    c.commit()
    assert not c.decide_first_block(filled(1.2))  # moved 0.2 > 0.15: compute, new reference
    c.computed_residual(filled(6.0))
    c.commit()
    assert c.decide_first_block(filled(1.3))  # 0.1 / 1.2 < 0.15 against 1.2: reuse
    c.commit()
    # a reused step keeps the reference: 1.38 is 0.15 from 1.2 (not 0.06 from 1.3)
    assert not c.decide_first_block(filled(1.2 * 1.16))
    c.computed_residual(filled(7.0))
    c.commit()
    assert c.reused_steps == [2]
    assert torch.equal(c.residual, filled(7.0))
    m = c.metrics()
    assert (m.steps_computed, m.steps_reused, m.reused_steps) == (3, 1, [2])


def test_a_threshold_of_zero_reuses_nothing():
    c = cache(FIRST_BLOCK, 0.0)
    for _ in range(4):
        assert not c.decide_first_block(filled(1.0))  # metric 0 is not below 0
        c.computed_residual(filled(1.0))
        c.commit()
    t = cache(TEACACHE, 0.0)
    for _ in range(4):
        assert not t.decide_teacache(filled(1.0))
        t.computed_residual(filled(1.0))
        t.commit()
    assert c.metrics().steps_reused == t.metrics().steps_reused == 0


def test_teacache_accumulates_the_rescaled_change_and_computes_the_first_and_last_steps():
    c = cache(TEACACHE, 0.25, steps=6, rescale=(2.0, 0.0))  # rescaled(d) = 2d
    decisions = []
    for value in (1.0, 1.1, 1.21, 1.331, 1.4641, 1.61051):  # each 10 % above the last
        reused = c.decide_teacache(filled(value))
        if not reused:
            c.computed_residual(filled(0.5))
        c.commit()
        decisions.append(reused)
    # step 0 computes; then 0.2 < 0.25 reuses, 0.4 computes (reset); 0.2 reuses,
    # 0.4 computes; the last step computes whatever the sum
    assert decisions == [False, True, False, True, False, False]
    assert c.metrics().reused_steps == [1, 3]


def test_rescaling_is_the_polynomial_highest_power_first():
    coefficients = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00,
                    2.64230861e-01)
    for d in (0.01, 0.1, 0.3):
        assert rescaled(d, coefficients) == pytest.approx(np.polyval(coefficients, d))
    assert rescaled(0.3, ()) == 0.3
    # a fit that dips below zero outside its range adds nothing there
    assert np.polyval((-50.0, 1.0), 0.1) < 0 and rescaled(0.1, (-50.0, 1.0)) == 0.0


def test_relative_l1_against_zeros_computes():
    assert relative_l1(filled(1.0), filled(0.0)) == float("inf")
    c = cache(FIRST_BLOCK, 1e9)
    c.decide_first_block(filled(0.0))
    c.computed_residual(filled(1.0))
    c.commit()
    assert not c.decide_first_block(filled(1.0))


def test_a_decision_becomes_the_requests_only_when_its_step_is_applied():
    """A step batch that fails is retried request by request: the retry
    decides from the same state as the failed attempt."""
    c = cache(FIRST_BLOCK, 0.5)
    c.decide_first_block(filled(1.0))
    c.computed_residual(filled(3.0))
    c.commit()
    assert c.decide_first_block(filled(1.1))  # the attempt that fails: never committed
    assert not c.decide_first_block(filled(2.0))  # the retry: 1.0 from 1.0 computes
    c.computed_residual(filled(4.0))
    c.commit()
    assert c.step == 2 and c.reused_steps == []
    assert torch.equal(c.reference, filled(2.0))


def test_a_request_whose_state_does_not_fit_the_bound_runs_uncached():
    budget = CacheBudget(filled(0).numel() * 4 * 2)  # one request's reference and residual
    first, second = cache(FIRST_BLOCK, 0.5, budget=budget), cache(FIRST_BLOCK, 0.5, budget=budget)
    for c in (first, second):
        c.decide_first_block(filled(1.0))
        c.computed_residual(filled(3.0))
        c.commit()
    assert first.active and budget.used() == first.nbytes > 0
    assert not second.active and second.nbytes == 0
    assert second.metrics().uncached_reason == STATE_BOUND
    second.commit()  # later steps count as computed, uncached
    assert second.metrics().steps_computed == 2
    first.free()
    assert budget.used() == 0
    third = cache(FIRST_BLOCK, 0.5, budget=budget)
    third.decide_first_block(filled(1.0))
    third.computed_residual(filled(3.0))
    third.commit()
    assert third.active
    del third  # a state dropped without free() stops counting with it
    gc.collect()
    assert budget.used() == 0
