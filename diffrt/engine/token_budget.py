"""The default ``max_num_batched_tokens``: where a larger step stops paying.

A denoise step costs ``o + k x W`` seconds (``engine.run_time``): a fixed
overhead ``o`` (launches, the Python around the forward) plus work that grows
with its tokens. Batching more tokens into one step amortises ``o`` and
nothing else, while every token added makes each request in the step wait
longer. So the default budget is the step at which the overhead is
``OVERHEAD_SHARE`` of the step's time: ``k x W = o (1 - share) / share``,
counted in tokens through the linear term (``W`` ~ tokens; attention's
quadratic term only makes a step reach that point sooner, so the budget
errs large). Past it a step gains at most that share in throughput and
costs its requests' latency in full.

It is derived once, at warm-up, from the calibration requests of two sizes
(the fit needs two, far enough apart in work, to tell ``o`` from ``k``;
``DiffusionEngine._calibration_requests``). Their ticks also carry the
requests' prompt encoding and decode, which the fit reads as overhead: the
derived budget errs large. Where ``o`` is less than a tenth of even the
smallest calibration step — a compute-bound step, as every tiny model's on
this CPU, where a fitted ``o`` swung between 0 and a few ms from run to run —
a larger step gains nothing and there is no bound (at that point the rule
would give about one small row, and the fit's noise would decide).
"""

from __future__ import annotations

#: the overhead's share of a step at the default budget
OVERHEAD_SHARE = 0.1


def derived_token_budget(coefficients: tuple[float, float] | None,
                         smallest: float) -> int | None:
    """Tokens a step may take by default, from the run-time fit ``(o, k)``
    (seconds of overhead a step, seconds a work unit — about a token while
    attention's quadratic term is small); ``smallest``: the work of the
    smallest calibration step. None (no bound) where the overhead is less
    than ``OVERHEAD_SHARE`` of even that step: a fit's overhead that small is
    its noise, and no step would gain from more tokens."""
    if coefficients is None:
        return None
    overhead, per_unit = coefficients
    if overhead <= 0 or per_unit <= 0:
        return None
    if overhead < OVERHEAD_SHARE * (overhead + per_unit * smallest):
        return None
    return max(1, round(overhead * (1 - OVERHEAD_SHARE) / OVERHEAD_SHARE / per_unit))
