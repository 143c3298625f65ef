"""The default ``max_num_batched_tokens``: where a larger step stops paying.

By the step-cost model (``step_cost``), a step costs a fixed ``o`` (its
transformer call and its share of the tick's round trip: ``c_call +
c_tick / steps a tick``) plus ``c_token`` a token (and attention's quadratic
term). Batching more tokens into one step amortises ``o`` and nothing else,
while every token added makes each request in the step wait longer. So the
default budget is the step at which the overhead is ``OVERHEAD_SHARE`` of
the step's time: ``c_token x T = o (1 - share) / share`` (the quadratic term
only makes a step reach that point sooner, so the budget errs large). Past
it a step gains at most that share in throughput and costs its requests'
latency in full. Where ``o`` is less than that share of even the smallest
calibration step (a compute-bound step, as every tiny model's on this CPU)
a larger step gains nothing and there is no bound.

It is derived from the engine's *idle* model (``RunTimeModel.idle``: the
fastest calibration measured, persisted across starts), not from the
momentary speed of the warm-up, so it is the same at every start on one
machine (the warm-up's own fit swung it from 1,503 to 280,443 tokens between
two runs).
"""

from __future__ import annotations

from collections.abc import Mapping

from diffrt.engine.step_cost import StepShape

#: the overhead's share of a step at the default budget
OVERHEAD_SHARE = 0.1


def derived_token_budget(coefficients: Mapping[str, float] | None, smallest: StepShape,
                         steps_per_tick: int = 1) -> int | None:
    """Tokens a step may take by default, from the step-cost coefficients
    (``step_cost.FEATURES``); ``smallest``: one step of the smallest
    calibration request. None (no bound) where the overhead is less than
    ``OVERHEAD_SHARE`` of even that step."""
    if coefficients is None:
        return None
    overhead = coefficients["call"] + coefficients["tick"] / max(1, steps_per_tick)
    per_token = coefficients["token"]
    if overhead <= 0 or per_token <= 0:
        return None
    work = per_token * smallest.tokens + coefficients["attention"] * smallest.attention
    if overhead < OVERHEAD_SHARE * (overhead + work):
        return None
    return max(1, round(overhead * (1 - OVERHEAD_SHARE) / OVERHEAD_SHARE / per_token))
