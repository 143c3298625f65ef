"""The step token budget (``max_num_batched_tokens``): a step's rows times its
longest row's tokens stay within it; a request over it waits for a later
boundary and alone always runs; the default is derived from the warm-up's
step times. Pure bookkeeping first, then the setting and its derivation."""

from __future__ import annotations

import pytest
from sched_helpers import req

from diffrt.engine import EngineConfig, EngineConfigError
from diffrt.engine.sched import ExecutionResult, StepScheduler, make_policy
from diffrt.engine.step_cost import StepShape
from diffrt.engine.token_budget import OVERHEAD_SHARE, derived_token_budget


def shape(request) -> tuple[int, int]:
    """(rows, tokens a row) in these tests: n rows of ``height`` tokens."""
    params = request.sampling_params
    return params.num_outputs_per_prompt or 1, params.height


def scheduler(budget: int | None, policy: str = "fifo", padded: bool = True) -> StepScheduler:
    return StepScheduler(8, make_policy(policy), key=lambda r: (), tokens=shape,
                         token_budget=budget, padded=padded)


def advance(out, steps: dict[str, int], finished: list[str] | None = None) -> ExecutionResult:
    return ExecutionResult(steps=steps, finished=finished or [])


def test_a_padded_step_counts_its_rows_times_its_longest_row():
    s = scheduler(400)
    for rid, size, n in [("a", 64, 2), ("b", 96, 1), ("c", 32, 1), ("d", 16, 1)]:
        s.add_request(req(rid, size=size, steps=3, num_outputs_per_prompt=n), now=0.0)
    out = s.schedule(now=0.0)
    # a: 2 x 64 = 128; + b: 3 rows x 96 = 288; + c: 4 x 96 = 384; + d: 5 x 96 = 480 > 400
    assert out.scheduled_ids == ["a", "b", "c"] and s.step_tokens() == (4, 384)
    s.update_from_output(out, advance(out, {rid: 1 for rid in out.scheduled_ids}))
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["a", "b", "c"] and s.num_waiting == 1  # still no room
    s.update_from_output(out, advance(out, {"a": 2, "c": 2}, finished=["b"]))
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["a", "c", "d"]  # b left: 4 rows x 64 = 256


def test_a_step_by_size_counts_each_rows_own_tokens():
    s = scheduler(300, padded=False)
    for rid, size, n in [("a", 64, 2), ("b", 96, 1), ("c", 32, 1), ("d", 16, 1)]:
        s.add_request(req(rid, size=size, steps=3, num_outputs_per_prompt=n), now=0.0)
    out = s.schedule(now=0.0)
    # a: 128; + b: 224; + c: 256; + d: 272 (padded, the same four would be 480)
    assert out.scheduled_ids == ["a", "b", "c", "d"] and s.step_tokens() == (5, 272)


def test_a_request_larger_than_the_budget_runs_alone():
    s = scheduler(100)
    s.add_request(req("huge", size=512), now=0.0)
    s.add_request(req("small", size=16), now=0.0)
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["huge"]
    s.update_from_output(out, advance(out, {}, finished=["huge"]))
    assert s.schedule(now=0.0).scheduled_ids == ["small"]


@pytest.mark.parametrize("budget", [None, 0])
def test_no_budget_packs_by_count_alone(budget):
    s = scheduler(budget)
    for rid in "abcd":
        s.add_request(req(rid, size=512), now=0.0)
    assert s.schedule(now=0.0).scheduled_ids == list("abcd")


def test_skip_ahead_keeps_the_budget_and_its_order():
    """The budget keeps a prefix of what skip_ahead chose: a small request
    behind one that waits for tokens does not pass it (no starvation)."""
    s = scheduler(150, policy="skip_ahead", padded=False)  # small alone: 96 + 16 fits
    s.add_request(req("running", size=96, steps=3), now=0.0)
    out = s.schedule(now=0.0)
    s.add_request(req("large", size=96), now=0.0)
    s.add_request(req("small", size=16), now=0.0)
    s.update_from_output(out, advance(out, {"running": 1}))
    assert s.schedule(now=0.0).scheduled_ids == ["running"] and s.num_waiting == 2


def coefficients(call: float, token: float, tick: float = 0.0) -> dict[str, float]:
    return {"call": call, "token": token, "attention": 0.0, "adapter_token": 0.0,
            "tick": tick, "encode": 0.0, "decode": 0.0}


def test_the_default_is_where_the_overhead_is_a_tenth_of_a_step():
    overhead, per_token = 0.02, 1e-5
    smallest = StepShape(calls=1, tokens=500)
    budget = derived_token_budget(coefficients(overhead, per_token), smallest)
    assert budget == round(overhead * 9 / per_token)
    assert overhead / (overhead + per_token * budget) == pytest.approx(OVERHEAD_SHARE)
    assert derived_token_budget(coefficients(0.0, 1e-5), smallest) is None  # nothing to amortise
    assert derived_token_budget(None, smallest) is None
    # an overhead under a tenth of the smallest measured step is the fit's noise
    assert derived_token_budget(coefficients(0.0004, 1e-5), smallest) is None
    assert derived_token_budget(coefficients(0.0006, 1e-5), smallest) == 540
    # a tick's fixed cost is shared by the steps it carries
    assert derived_token_budget(coefficients(0.0002, 1e-5, tick=0.0016), smallest,
                                steps_per_tick=4) == 540


@pytest.mark.parametrize("value", [-1, 1.5, "many"])
def test_a_bad_budget_is_refused_naming_the_field(value):
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=value)


def test_the_engine_derives_its_budget_from_the_idle_model_the_same_at_every_start(
        tmp_path, monkeypatch):
    """The budget comes from the idle step-cost model, which the first start
    calibrates and persists: later starts read it back (a slower calibration
    never replaces it) and derive the same budget."""
    from diffrt.engine import DiffusionEngine

    with DiffusionEngine.make_engine(EngineConfig(
            executor_backend="inproc", step_execution=True, max_num_seqs=4)) as engine:
        run_time = engine.run_time
        assert run_time.idle is not None and not run_time.restored
        assert engine.scheduler.token_budget == derived_token_budget(
            run_time.idle, run_time.calibration_shapes()[0], run_time.steps_per_tick)
        first = run_time.reference()
    with DiffusionEngine.make_engine(EngineConfig(
            executor_backend="inproc", step_execution=True, max_num_seqs=4,
            max_num_batched_tokens=0)) as engine:
        assert engine.scheduler.token_budget is None  # 0: no bound, nothing derived
        # calibrated from the start, and never slower than the persisted idle speed
        assert engine.run_time.reference() <= first
