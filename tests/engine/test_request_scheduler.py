"""RequestScheduler: waves, fused compatible batches, coalescing window, lifecycle."""

from __future__ import annotations

import pytest
from sched_helpers import all_done, req

from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    RequestScheduler,
    RequestStatus,
    make_policy,
)


def test_serial_one_request_per_wave():
    s = RequestScheduler(max_num_seqs=1)
    for i in range(3):
        s.add_request(req(f"r{i}"), now=0.0)
    order = []
    while s.has_work():
        out = s.schedule(now=1.0)
        assert len(out.scheduled_ids) == 1
        assert s.schedule(now=1.0) is None  # one wave at a time
        up = s.update_from_output(out, all_done(out))
        order += [f.request_id for f in up.finished]
        assert all(f.status is RequestStatus.FINISHED and f.has_output for f in up.finished)
    assert order == ["r0", "r1", "r2"]
    assert s.num_waiting == s.num_running == 0


def test_fused_wave_takes_compatible_requests_up_to_capacity():
    s = RequestScheduler(max_num_seqs=3)
    for i in range(5):
        s.add_request(req(f"r{i}"), now=0.0)
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["r0", "r1", "r2"]
    assert [r.request_id for r in out.new] == ["r0", "r1", "r2"]
    s.update_from_output(out, all_done(out))
    assert s.schedule(now=0.0).scheduled_ids == ["r3", "r4"]


def test_different_step_counts_never_share_a_request_wave():
    s = RequestScheduler(max_num_seqs=4)
    s.add_request(req("a", steps=2), now=0.0)
    s.add_request(req("b", steps=3), now=0.0)
    s.add_request(req("c", steps=2), now=0.0)
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["a"]  # fifo: b blocks c


def test_fifo_head_of_line_blocking_and_skip_ahead():
    def first_wave(policy):
        s = RequestScheduler(max_num_seqs=4, policy=make_policy(policy))
        s.add_request(req("a", size=64), now=0.0)
        s.add_request(req("b", size=128), now=0.0)
        s.add_request(req("c", size=64), now=0.0)
        return s.schedule(now=0.0).scheduled_ids

    assert first_wave("fifo") == ["a"]
    assert first_wave("skip_ahead") == ["a", "c"]


def test_errors_map_to_their_request_ids():
    s = RequestScheduler(max_num_seqs=3)
    for i in range(3):
        s.add_request(req(f"r{i}"), now=0.0)
    out = s.schedule(now=0.0)
    up = s.update_from_output(out, ExecutionResult(finished=["r0", "r2"], errors={"r1": "boom"}))
    by_id = {f.request_id: f for f in up.finished}
    assert by_id["r1"].status is RequestStatus.FAILED and by_id["r1"].error == "boom"
    assert by_id["r0"].has_output and by_id["r2"].has_output
    assert not s.has_work()


def test_failed_call_fails_the_whole_wave_and_frees_outputs():
    s = RequestScheduler(max_num_seqs=2)
    s.add_request(req("a"), now=0.0)
    s.add_request(req("b"), now=0.0)
    out = s.schedule(now=0.0)
    up = s.update_from_output(out, ExecutionResult(failed_all="worker died"))
    assert [f.status for f in up.finished] == [RequestStatus.FAILED] * 2
    assert all(f.error == "worker died" for f in up.finished)


def test_abort_waiting_is_immediate_and_unknown_is_noop():
    s = RequestScheduler(max_num_seqs=1)
    s.add_request(req("a"), now=0.0)
    s.add_request(req("b"), now=0.0)
    outcome, ev = s.abort("b")
    assert outcome is AbortOutcome.DONE and ev.status is RequestStatus.ABORTED
    assert s.abort("b") == (AbortOutcome.UNKNOWN, None)
    assert s.abort("never") == (AbortOutcome.UNKNOWN, None)
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["a"]


def test_abort_between_schedule_and_update_releases_the_output():
    s = RequestScheduler(max_num_seqs=2)
    s.add_request(req("a"), now=0.0)
    s.add_request(req("b"), now=0.0)
    out = s.schedule(now=0.0)
    assert s.abort("a") == (AbortOutcome.DEFERRED, None)
    up = s.update_from_output(out, all_done(out))
    by_id = {f.request_id: f for f in up.finished}
    assert by_id["a"].status is RequestStatus.ABORTED
    assert not by_id["a"].has_output  # its output is freed by the engine
    assert by_id["b"].status is RequestStatus.FINISHED and by_id["b"].has_output
    assert not s.has_work()
    # The id is free again once terminal.
    s.add_request(req("a"), now=1.0)


def test_duplicate_active_id_refused():
    s = RequestScheduler()
    s.add_request(req("a"), now=0.0)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(req("a"), now=0.0)


def test_fail_all_finalises_everything():
    s = RequestScheduler(max_num_seqs=1)
    s.add_request(req("a"), now=0.0)
    s.add_request(req("b"), now=0.0)
    s.schedule(now=0.0)
    evs = s.fail_all("dead")
    assert sorted(e.request_id for e in evs) == ["a", "b"]
    assert not s.has_work() and s.num_running == 0


class TestCoalescingWindow:
    def make(self, **kw):
        return RequestScheduler(max_num_seqs=4, max_wait_s=0.100, stable_s=0.020, **kw)

    def test_disabled_without_wait(self):
        s = RequestScheduler(max_num_seqs=4)
        s.add_request(req("a"), now=0.0)
        assert s.admission_wait_s(now=0.0) == 0.0

    def test_the_automatic_window_follows_measured_run_times(self):
        """max_wait_s=None: no hold before anything ran; then a tenth of the
        moving average of run times (a lone request waits a quarter of that),
        capped at 50 ms; a fixed window ignores the measurements."""
        s = RequestScheduler(max_num_seqs=4, max_wait_s=None)
        s.add_request(req("a"), now=0.0)
        assert s.admission_wait_s(now=0.0) == 0.0  # nothing measured yet
        s.observe_run_time(0.200)
        assert s.max_wait_s == pytest.approx(0.020) and s.stable_s == pytest.approx(0.005)
        assert s.admission_wait_s(now=0.0) == pytest.approx(0.005)
        s.observe_run_time(0.400)  # the average moves halfway to each new time
        assert s.max_wait_s == pytest.approx(0.030)
        for _ in range(50):
            s.observe_run_time(30.0)
        assert s.max_wait_s == pytest.approx(0.050)  # capped
        fixed = RequestScheduler(max_num_seqs=4, max_wait_s=0.0)
        fixed.observe_run_time(1.0)
        fixed.add_request(req("b"), now=0.0)
        assert fixed.admission_wait_s(now=0.0) == 0.0

    def test_waits_while_queue_grows_until_stable(self):
        s = self.make()
        s.add_request(req("a"), now=0.000)
        assert s.admission_wait_s(now=0.000) == pytest.approx(0.020)
        s.add_request(req("b"), now=0.015)
        assert s.admission_wait_s(now=0.016) == pytest.approx(0.019)
        assert s.admission_wait_s(now=0.035) == 0.0  # no arrival for stable_s
        assert s.schedule(now=0.035).scheduled_ids == ["a", "b"]

    def test_ends_at_capacity(self):
        s = self.make()
        for i in range(4):
            s.add_request(req(f"r{i}"), now=0.001 * i)
        assert s.admission_wait_s(now=0.004) == 0.0

    def test_ends_at_the_window_end_even_if_still_growing(self):
        s = RequestScheduler(max_num_seqs=8, max_wait_s=0.100, stable_s=0.020)
        for i, t in enumerate((0.0, 0.015, 0.030, 0.045, 0.060, 0.075, 0.090)):
            s.add_request(req(f"r{i}"), now=t)
        assert s.admission_wait_s(now=0.099) == pytest.approx(0.001)
        assert s.admission_wait_s(now=0.100) == 0.0

    def test_no_wait_while_a_wave_runs(self):
        s = self.make()
        s.add_request(req("a"), now=0.0)
        out = s.schedule(now=1.0)
        s.add_request(req("b"), now=1.0)
        assert s.admission_wait_s(now=1.0) == 0.0
        s.update_from_output(out, all_done(out))
        # b has waited behind the wave longer than the window: go at once.
        assert s.admission_wait_s(now=1.2) == 0.0
