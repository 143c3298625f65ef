"""StepScheduler: join/leave at step boundaries, step counts, policies, aborts."""

from __future__ import annotations

import pytest
from sched_helpers import req

from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    RequestStatus,
    StepScheduler,
    make_policy,
)


class FakeWorker:
    """Mimics the runner's step bookkeeping: each tick advances every id by one."""

    def __init__(self):
        self.steps: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.dropped: list[str] = []
        self.batches: list[list[str]] = []

    def run(self, out, fail: dict[str, str] | None = None) -> ExecutionResult:
        fail = fail or {}
        for rid in out.drop_ids:
            self.dropped.append(rid)
            self.steps.pop(rid, None)
        for r in out.new:
            self.steps[r.request_id] = 0
            self.totals[r.request_id] = r.sampling_params.num_inference_steps
        self.batches.append(list(out.scheduled_ids))
        res = ExecutionResult()
        for rid in out.scheduled_ids:
            if rid in fail:
                res.errors[rid] = fail[rid]
                self.steps.pop(rid)
                continue
            self.steps[rid] += 1
            if self.steps[rid] >= self.totals[rid]:
                res.finished.append(rid)
                del self.steps[rid]
            else:
                res.steps[rid] = self.steps[rid]
        return res


def drive(s: StepScheduler, w: FakeWorker, ticks: int = 100, now: float = 0.0):
    """Run ticks until idle; return terminal events in order."""
    events = []
    for _ in range(ticks):
        out = s.schedule(now)
        if out is None:
            break
        events += s.update_from_output(out, w.run(out)).finished
    return events


def test_single_request_advances_one_step_per_tick():
    s, w = StepScheduler(max_num_seqs=1), FakeWorker()
    s.add_request(req("a", steps=3), now=0.0)
    progress = []
    for _ in range(3):
        out = s.schedule(0.0)
        assert out.scheduled_ids == ["a"]
        up = s.update_from_output(out, w.run(out))
        progress += [(p.step, p.total_steps) for p in up.progress]
    assert progress == [(1, 3), (2, 3)]
    assert up.finished[0].status is RequestStatus.FINISHED and up.finished[0].has_output
    assert s.schedule(0.0) is None


def test_different_step_counts_share_a_batch_and_leave_independently():
    s, w = StepScheduler(max_num_seqs=4), FakeWorker()
    s.add_request(req("short", steps=2), now=0.0)
    s.add_request(req("long", steps=4), now=0.0)
    events = drive(s, w)
    assert w.batches == [["short", "long"], ["short", "long"], ["long"], ["long"]]
    assert [e.request_id for e in events] == ["short", "long"]


def test_requests_join_at_step_boundaries_when_capacity_frees():
    s, w = StepScheduler(max_num_seqs=2), FakeWorker()
    s.add_request(req("a", steps=2), now=0.0)
    s.add_request(req("b", steps=3), now=0.0)
    s.add_request(req("c", steps=2), now=0.0)
    out = s.schedule(0.0)
    assert out.scheduled_ids == ["a", "b"] and [r.request_id for r in out.new] == ["a", "b"]
    s.update_from_output(out, w.run(out))
    # c joins as soon as a leaves (after tick 2), mid-way through b.
    drive(s, w)
    assert w.batches == [["a", "b"], ["a", "b"], ["b", "c"], ["c"]]


def test_incompatible_requests_never_share_a_tick():
    s, w = StepScheduler(max_num_seqs=4), FakeWorker()
    s.add_request(req("a", size=64), now=0.0)
    s.add_request(req("b", size=128), now=0.0)
    drive(s, w)
    for batch in w.batches:
        assert len({("a" in batch), ("b" in batch)}) == 1 or len(batch) == 1


def _hol_scenario(policy: str, max_bypass: int = 4):
    """Running batch of 64px requests that keeps getting compatible arrivals,
    with one 128px request waiting. Returns the tick at which it starts."""
    s = StepScheduler(max_num_seqs=2, policy=make_policy(policy, max_bypass=max_bypass))
    w = FakeWorker()
    s.add_request(req("a0", size=64, steps=1), now=0.0)  # staggered: never drains
    s.add_request(req("big", size=128, steps=2), now=0.0)
    started_at = None
    for tick in range(40):
        if tick < 20:  # a steady stream of compatible requests
            s.add_request(req(f"a{tick + 1}", size=64, steps=2), now=float(tick))
        out = s.schedule(float(tick))
        if out is None:
            break
        if "big" in out.scheduled_ids and started_at is None:
            started_at = tick
        s.update_from_output(out, w.run(out))
    return started_at, w


def test_fifo_blocks_compatible_joiners_behind_an_incompatible_head():
    started, w = _hol_scenario("fifo")
    # a0 runs alone (capacity 2, a1 is compatible but behind "big"), then big.
    assert w.batches[0] == ["a0"]
    assert started == 1 and w.batches[1] == ["big"]


def test_skip_ahead_fills_the_batch_then_ages_the_skipped_request():
    started, w = _hol_scenario("skip_ahead", max_bypass=3)
    assert w.batches[0] == ["a0", "a1"]  # a1 joins past "big"
    assert started is not None  # ...but "big" is not starved
    # big was overtaken exactly max_bypass times, then the batch drained.
    before = [rid for b in w.batches[:started] for rid in b]
    overtakers = sorted({rid for rid in before if rid != "a0"}, key=lambda r: int(r[1:]))
    assert len(overtakers) == 3
    assert w.batches[started] == ["big"]


def test_skip_ahead_with_zero_bypass_is_fifo():
    assert _hol_scenario("skip_ahead", max_bypass=0)[0] == _hol_scenario("fifo")[0]


def test_abort_waiting_running_and_in_flight():
    s, w = StepScheduler(max_num_seqs=2), FakeWorker()
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, steps=5), now=0.0)
    out = s.schedule(0.0)
    s.update_from_output(out, w.run(out))
    # waiting: removed at once, the worker never saw it
    assert s.abort("c")[0] is AbortOutcome.DONE
    # running between ticks: removed at once; next tick drops its worker state
    outcome, ev = s.abort("a")
    assert outcome is AbortOutcome.DONE and ev.status is RequestStatus.ABORTED
    out = s.schedule(0.0)
    assert out.drop_ids == ["a"] and out.scheduled_ids == ["b"]
    # in flight: deferred to the update, then dropped on the worker
    assert s.abort("b") == (AbortOutcome.DEFERRED, None)
    up = s.update_from_output(out, w.run(out))
    assert up.finished[0].status is RequestStatus.ABORTED and not up.progress
    out = s.schedule(0.0)
    assert out.scheduled_ids == [] and out.drop_ids == ["b"]
    s.update_from_output(out, w.run(out))
    assert w.dropped == ["a", "b"] and w.steps == {}
    assert not s.has_work() and s.schedule(0.0) is None


def test_abort_in_flight_on_the_final_step_releases_the_output():
    s, w = StepScheduler(max_num_seqs=1), FakeWorker()
    s.add_request(req("a", steps=1), now=0.0)
    out = s.schedule(0.0)
    s.abort("a")
    up = s.update_from_output(out, w.run(out))
    ev = up.finished[0]
    assert ev.status is RequestStatus.ABORTED and not ev.has_output
    assert s.schedule(0.0) is None  # nothing to drop: the worker already let go


def test_error_in_one_request_leaves_the_others_running():
    s, w = StepScheduler(max_num_seqs=3), FakeWorker()
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, steps=2), now=0.0)
    out = s.schedule(0.0)
    up = s.update_from_output(out, w.run(out, fail={"b": "nan in latents"}))
    assert [(f.request_id, f.error) for f in up.finished] == [("b", "nan in latents")]
    assert sorted(p.request_id for p in up.progress) == ["a", "c"]
    events = drive(s, w)
    assert sorted(e.request_id for e in events) == ["a", "c"]


def test_failed_call_fails_the_tick_and_drops_worker_state():
    s = StepScheduler(max_num_seqs=2)
    s.add_request(req("a", steps=3), now=0.0)
    s.add_request(req("b", steps=3), now=0.0)
    out = s.schedule(0.0)
    up = s.update_from_output(out, ExecutionResult(failed_all="RuntimeError: x"))
    assert all(f.status is RequestStatus.FAILED for f in up.finished)
    out = s.schedule(0.0)
    assert out.drop_ids == ["a", "b"] and out.scheduled_ids == []


def test_coalescing_window_only_for_a_batch_forming_from_scratch():
    s, w = StepScheduler(max_num_seqs=4, max_wait_s=0.100, stable_s=0.020), FakeWorker()
    s.add_request(req("a", steps=3), now=0.0)
    assert s.admission_wait_s(now=0.005) == pytest.approx(0.015)  # nothing runs: hold
    s.add_request(req("b", steps=3), now=0.010)
    assert s.admission_wait_s(now=0.030) == 0.0  # no arrival for stable_s
    out = s.schedule(0.030)
    assert out.scheduled_ids == ["a", "b"]
    s.update_from_output(out, w.run(out))
    s.add_request(req("c", steps=3), now=0.040)
    assert s.admission_wait_s(now=0.040) == 0.0  # joining a running batch never waits
    assert s.schedule(0.040).scheduled_ids == ["a", "b", "c"]


def test_ticks_run_several_steps_after_admission_never_past_a_finish():
    """max_steps_per_tick: every tick admits first, then asks for several steps,
    never past the first running request's end; a waiting request the policy
    refused (another size behind FIFO's head, or no room) does not shorten
    ticks; a tick with state to drop runs one step."""
    s = StepScheduler(max_num_seqs=2, max_steps_per_tick=4)
    s.add_request(req("a", steps=10), now=0.0)
    out = s.schedule(now=0.0)
    assert out.steps == 4
    s.update_from_output(out, ExecutionResult(steps={"a": 4}))
    s.add_request(req("b", steps=3), now=0.1)  # joins at this boundary, ends first
    out = s.schedule(now=0.1)
    assert out.scheduled_ids == ["a", "b"] and out.steps == 3
    up = s.update_from_output(out, ExecutionResult(steps={"a": 7}, finished=["b"]))
    assert [(p.request_id, p.step) for p in up.progress] == [
        ("a", 5), ("a", 6), ("a", 7), ("b", 1), ("b", 2)]  # one progress item per step
    s.add_request(req("other-size", size=128, steps=3), now=0.2)  # cannot join a 64 batch
    s.add_request(req("c", steps=3), now=0.3)  # FIFO: behind the head, refused too
    out = s.schedule(now=0.3)
    assert out.scheduled_ids == ["a"] and out.steps == 3  # a has 3 steps left
    s.update_from_output(out, ExecutionResult(steps={"a": 8}))  # stopped early (a preview)
    s.abort("a")  # not in flight: leaves now, its worker state is dropped next tick
    out = s.schedule(now=0.4)
    assert out.drop_ids == ["a"] and out.scheduled_ids == ["other-size"] and out.steps == 1
