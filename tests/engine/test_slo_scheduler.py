"""The ``slo`` policy without a model: the order by priority, then slack,
aging and its bound, the token budget, preemption at step boundaries and its
byte bound, a paused request's endings, refusal by deadline, request mode."""

from __future__ import annotations

import pytest
from sched_helpers import req

from diffrt.engine import EngineConfig
from diffrt.engine.record import RequestStatus
from diffrt.engine.sampling import MAX_PRIORITY, MIN_PRIORITY, InvalidRequestError, SamplingParams
from diffrt.engine.sched import (
    AbortOutcome,
    ExecutionResult,
    RequestScheduler,
    SloPolicy,
    StepScheduler,
    make_policy,
)


class Cost:
    """A step-time model of ``per_unit`` seconds per token of a row, no overhead
    unless given (a request's units are its height, as in ``shape``)."""

    def __init__(self, per_unit: float = 0.001, overhead: float = 0.0):
        self.step_overhead: float | None = overhead
        self.per_unit = per_unit

    def work_seconds(self, request) -> float:
        return self.per_unit * request.sampling_params.height


def shape(request) -> tuple[int, int]:
    return 1, request.sampling_params.height


def step_scheduler(seats: int = 2, *, paused_bytes: int = 1 << 30, budget: int | None = None,
                   aging: int = 4, cost: Cost | None = None) -> StepScheduler:
    return StepScheduler(seats, make_policy("slo", aging_ticks=aging, cost=cost or Cost()),
                         key=lambda r: (), tokens=shape, token_budget=budget,
                         max_paused_bytes=paused_bytes)


def tick(s: StepScheduler, now: float = 0.0, *, state_bytes: int = 100, finished=()):
    """One tick: every scheduled request advances a step (those in
    ``finished`` finish), reporting ``state_bytes`` of step state each."""
    out = s.schedule(now)
    assert out is not None
    steps, done = {}, []
    for rid in out.scheduled_ids:
        record = s.record(rid)
        assert record is not None
        if rid in finished or record.step + 1 >= record.total_steps:
            done.append(rid)
        else:
            steps[rid] = record.step + 1
    update = s.update_from_output(out, ExecutionResult(
        steps=steps, finished=done, state_bytes=dict.fromkeys(steps, state_bytes)))
    return out, update


# -- the order ------------------------------------------------------------------------------
def test_priority_first_then_least_slack_then_arrival():
    policy = SloPolicy(aging_ticks=100, cost=Cost(per_unit=0.001))
    s = RequestScheduler(1, policy, key=lambda r: ())
    arrivals = [("batch", dict(priority=1, deadline_s=0.5)),
                ("loose", dict(deadline_s=10.0)),
                ("none", {}),
                ("tight", dict(deadline_s=2.0)),
                ("none-later", {}),
                ("urgent", dict(priority=-3))]
    for rid, kw in arrivals:
        s.add_request(req(rid, steps=10, **kw), now=0.0)
    order = [r.request_id for r in policy.ordered(list(s._waiting), now=0.0)]
    # priority -3, then class 0 by slack (deadlines before none, arrival among
    # those without one), then class 1 though its deadline is the nearest
    assert order == ["urgent", "tight", "loose", "none", "none-later", "batch"]


def test_slack_counts_the_remaining_work_from_the_measured_step_time():
    policy = SloPolicy(cost=Cost(per_unit=0.01))  # 64 px: 0.64 s a step
    s = StepScheduler(2, policy, key=lambda r: ())
    long = s.add_request(req("long", size=64, steps=10, deadline_s=8.0), now=0.0)
    short = s.add_request(req("short", size=64, steps=2, deadline_s=5.0), now=0.0)
    # long: 8 - 6.4 = 1.6 s of slack; short: 5 - 1.28 = 3.72 s
    assert policy.slack(long, 0.0) == pytest.approx(1.6)
    assert policy.slack(short, 0.0) == pytest.approx(3.72)
    assert [r.request_id for r in policy.ordered([short, long], 0.0)] == ["long", "short"]
    long.step = 5  # half done: 8 - 1 - 3.2
    assert policy.slack(long, 1.0) == pytest.approx(3.8)
    # before a measured tick: the time left to the deadline
    assert SloPolicy().slack(long, 1.0) == pytest.approx(7.0)


def test_waiting_requests_age_a_class_every_aging_ticks():
    """A priority-1 request under a sustained stream of fresh priority-0
    requests with deadlines (one seat, one step each): passed over while its
    class is worse, tied on class it still loses on slack (finite beats
    none), and admitted the tick it becomes more urgent: after 2 x aging
    ticks, the bound the module states for a class one apart."""
    aging = 4
    s = step_scheduler(seats=1, aging=aging)
    s.add_request(req("low", steps=1, priority=1), now=0.0)
    for t in range(3 * aging):
        s.add_request(req(f"high{t}", steps=1, deadline_s=1.0), now=float(t))
        out, _ = tick(s, float(t))
        if out.scheduled_ids == ["low"]:
            break
    assert t == 2 * aging
    assert s.record(f"high{t}") is not None  # the fresh one waits its turn


def test_a_request_with_a_deadline_ages_once_it_has_passed_only():
    """Before its deadline its slack speaks for it: aging it then would rank
    batch work that can still wait above another class's promise."""
    policy = SloPolicy(aging_ticks=2)
    waiting = [RequestScheduler(1, policy, key=lambda r: ()).add_request(
        req(rid, steps=4, priority=1, **kw), now=0.0)
        for rid, kw in (("in-time", dict(deadline_s=10.0)), ("none", {}))]
    for t in range(4):
        policy.waited(waiting, now=float(t))
    assert [r.waited_ticks for r in waiting] == [0, 4]
    assert [policy.urgency(r) for r in waiting] == [1, -1]
    for t in range(11, 13):  # past its deadline: it ages like the rest
        policy.waited(waiting, now=float(t))
    assert [r.waited_ticks for r in waiting] == [2, 6]


def test_lost_requests_follow_those_that_can_still_make_it():
    """Within a class the least slack goes first only while it is not
    negative: a request that can no longer make its deadline waits, in
    arrival order with those that have none, so it does not make the ones
    behind it late too. Another class still comes after all of them."""
    policy = SloPolicy(aging_ticks=100, cost=Cost(per_unit=0.01))  # 64 px: 0.64 s a step
    s = RequestScheduler(1, policy, key=lambda r: ())
    for rid, kw in [("lost-old", dict(deadline_s=1.0)), ("none", {}),
                    ("lost-new", dict(deadline_s=2.0)), ("tight", dict(deadline_s=4.0)),
                    ("loose", dict(deadline_s=9.0)), ("other-class", dict(priority=1,
                                                                         deadline_s=4.0))]:
        s.add_request(req(rid, size=64, steps=4, **kw), now=0.0)  # 2.56 s of work each
    order = [r.request_id for r in policy.ordered(list(s._waiting), now=0.0)]
    assert order == ["tight", "loose", "lost-old", "none", "lost-new", "other-class"]
    assert policy.slack(s.record("lost-new"), 0.0) < 0 < policy.slack(s.record("tight"), 0.0)


def test_the_token_budget_holds_in_urgency_order():
    s = step_scheduler(seats=4, budget=200)
    s.add_request(req("big", size=128, steps=3, priority=1), now=0.0)
    s.add_request(req("mid", size=96, steps=3), now=0.0)
    s.add_request(req("small", size=64, steps=3), now=0.0)
    out, _ = tick(s)
    # most urgent first: mid 96 + small 64 = 160; big would make 288
    assert out.scheduled_ids == ["mid", "small"] and s.num_waiting == 1


# -- preemption -----------------------------------------------------------------------------
def test_a_more_urgent_request_pauses_the_least_urgent_running_one():
    s = step_scheduler(seats=2)
    s.add_request(req("low-a", steps=20, priority=2), now=0.0)
    s.add_request(req("low-b", steps=20, priority=1), now=0.0)
    tick(s)
    s.add_request(req("high", steps=3), now=0.1)
    out, _ = tick(s, 0.1)
    # the next boundary: "high" is sent in full, priority 2 is paused (not
    # advanced, its state not dropped), priority 1 runs on
    assert [r.request_id for r in out.new] == ["high"]
    assert out.scheduled_ids == ["low-b", "high"] and out.drop_ids == []
    paused = s.record("low-a")
    assert paused is not None and paused.status is RequestStatus.PAUSED
    assert (s.num_paused, s.preemptions, s.paused_state_bytes()) == (1, 1, 100)
    while s.record("high") is not None:
        out, _ = tick(s, 0.2)
    out, _ = tick(s, 0.3)  # resumed at its step: advanced, not sent again
    assert out.new == [] and out.scheduled_ids == ["low-b", "low-a"]
    assert paused.step == 2 and paused.preemptions == 1
    assert (s.num_paused, s.paused_state_bytes()) == (0, 0)


def test_no_preemption_within_a_class_and_none_when_there_is_room():
    s = step_scheduler(seats=2)
    s.add_request(req("a", steps=20, deadline_s=100.0), now=0.0)
    s.add_request(req("b", steps=20), now=0.0)
    tick(s)
    s.add_request(req("tight", steps=3, deadline_s=0.5), now=0.1)  # same class: waits
    out, _ = tick(s, 0.1)
    assert out.scheduled_ids == ["a", "b"] and s.preemptions == 0
    s2 = step_scheduler(seats=3)
    s2.add_request(req("low", steps=20, priority=5), now=0.0)
    tick(s2)
    s2.add_request(req("high", steps=3), now=0.1)
    out, _ = tick(s2, 0.1)
    assert out.scheduled_ids == ["low", "high"] and s2.preemptions == 0


def test_preemption_makes_room_in_the_token_budget_too():
    s = step_scheduler(seats=4, budget=200)
    s.add_request(req("low", size=128, steps=20, priority=1), now=0.0)
    s.add_request(req("low-small", size=32, steps=20, priority=1), now=0.0)
    tick(s)
    s.add_request(req("high", size=96, steps=3), now=0.1)
    out, _ = tick(s, 0.1)
    # 128 + 32 + 96 > 200: pausing the later one (low-small) is not enough,
    # pausing both is; low-small is then given back (32 + 96 fits)
    assert s.record("low").status is RequestStatus.PAUSED
    assert out.scheduled_ids == ["low-small", "high"] and s.preemptions == 1


def test_paused_state_is_bounded_in_bytes():
    s = step_scheduler(seats=2, paused_bytes=1000)
    for rid in ("low-a", "low-b"):
        s.add_request(req(rid, steps=20, priority=1), now=0.0)
    tick(s, state_bytes=600)
    s.add_request(req("high-a", steps=5), now=0.1)
    s.add_request(req("high-b", steps=5), now=0.1)
    out, _ = tick(s, 0.1, state_bytes=600)
    # one pause keeps 600 bytes; a second would keep 1200 > 1000: high-b waits
    assert (s.num_paused, s.paused_state_bytes(), s.preemptions) == (1, 600, 1)
    assert len(out.scheduled_ids) == 2 and s.num_waiting == 1
    off = step_scheduler(seats=1, paused_bytes=0)  # 0: no preemption at all
    off.add_request(req("low", steps=20, priority=1), now=0.0)
    tick(off)
    off.add_request(req("high", steps=5), now=0.1)
    out, _ = tick(off, 0.1)
    assert out.scheduled_ids == ["low"] and off.preemptions == 0


def test_a_paused_request_aborted_or_failed_is_dropped_in_the_worker():
    s = step_scheduler(seats=1)
    s.add_request(req("low", steps=20, priority=1), now=0.0)
    tick(s)
    s.add_request(req("high", steps=5), now=0.1)
    tick(s, 0.1)
    outcome, event = s.abort("low")
    assert outcome is AbortOutcome.DONE and event.status is RequestStatus.ABORTED
    out, _ = tick(s, 0.2)
    assert out.drop_ids == ["low"] and s.num_paused == 0
    s.add_request(req("low2", steps=20, priority=1), now=0.3)
    while s.record("high") is not None:
        tick(s, 0.3)
    tick(s, 0.4)
    s.add_request(req("high2", steps=5), now=0.5)
    tick(s, 0.5)
    assert s.num_paused == 1
    failed = s.fail_running("worker died")
    assert {e.request_id for e in failed} == {"low2", "high2"} and s.num_paused == 0
    assert not s.has_work()


def test_fifo_and_skip_ahead_never_preempt():
    for name in ("fifo", "skip_ahead"):
        s = StepScheduler(1, make_policy(name), key=lambda r: (), max_paused_bytes=1 << 30)
        s.add_request(req("low", steps=20, priority=5), now=0.0)
        tick(s)
        s.add_request(req("high", steps=5, priority=-5), now=0.1)
        out, _ = tick(s, 0.1)
        assert out.scheduled_ids == ["low"] and s.preemptions == 0


# -- refusal by deadline ----------------------------------------------------------------------
def test_lateness_counts_the_running_and_the_queue_ranked_ahead():
    s = step_scheduler(seats=2, cost=Cost(per_unit=0.01))  # 64 px: 0.64 s a step
    s.add_request(req("running", steps=10), now=0.0)
    tick(s)  # 9 steps left: 5.76 s
    s.add_request(req("queued-urgent", steps=5, priority=-1), now=0.0)  # 3.2 s, ahead
    s.add_request(req("queued-later", steps=5, priority=3), now=0.0)  # behind: not counted
    from diffrt.engine.record import RequestRecord
    me = RequestRecord(req("me", steps=5, deadline_s=10.0), arrival=0.0)  # 3.2 s
    assert s.lateness(me, 0.0) == pytest.approx(5.76 + 3.2 + 3.2 - 10.0)
    meets = RequestRecord(req("me2", steps=1, deadline_s=10.0), arrival=0.0)
    assert s.lateness(meets, 0.0) < 0
    none = RequestRecord(req("me3", steps=1), arrival=0.0)
    assert s.lateness(none, 0.0) is None
    fifo = StepScheduler(2, make_policy("fifo"), key=lambda r: ())
    assert fifo.lateness(me, 0.0) is None
    unmeasured = step_scheduler(cost=Cost())
    unmeasured.policy.cost.step_overhead = None  # type: ignore[attr-defined]
    assert unmeasured.lateness(me, 0.0) is None


# -- request mode -------------------------------------------------------------------------------
def test_request_mode_orders_its_waves_by_the_same_policy():
    s = RequestScheduler(2, make_policy("slo", cost=Cost()), key=lambda r: (r.sampling_params.height,))
    s.add_request(req("batch-1", size=64, priority=1), now=0.0)
    s.add_request(req("batch-2", size=64, priority=1), now=0.0)
    s.add_request(req("urgent", size=32), now=0.0)
    s.add_request(req("urgent-2", size=32, deadline_s=1.0), now=0.0)
    out = s.schedule(0.0)
    assert out.scheduled_ids == ["urgent-2", "urgent"]  # its key: the most urgent's


# -- the fields --------------------------------------------------------------------------------
def test_priority_and_deadline_are_checked_naming_the_field():
    base = dict(height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                true_cfg_scale=1.0)
    for field, value in (("priority", MIN_PRIORITY - 1), ("priority", MAX_PRIORITY + 1),
                         ("deadline_s", 0.0), ("deadline_s", -1.0)):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**base, **{field: value}).validate()
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="timeout_s") as info:
        SamplingParams(**base, deadline_s=5.0, timeout_s=2.0).validate()
    assert info.value.field == "deadline_s"
    SamplingParams(**base, deadline_s=2.0, timeout_s=2.0, priority=-10).validate()
    assert EngineConfig(scheduling_policy="slo").scheduling.scheduling_policy == "slo"


# -- what preemption must not do ------------------------------------------------------------
class Slots:
    """Adapter slots for the scheduler: requests whose prompt starts with
    "lora" never find one; the others need none."""

    def admit(self, record, *, blocked: bool) -> bool:
        return self.could_admit(record)

    def could_admit(self, record) -> bool:
        return not record.request.prompt.startswith("lora")

    def release(self, record) -> None:
        pass


def test_no_request_is_paused_for_one_whose_adapters_find_no_slot():
    s = step_scheduler(seats=1)
    s.adapters = Slots()
    s.add_request(req("low", steps=20, priority=1), now=0.0)
    tick(s)
    s.add_request(req("lora-urgent", steps=5), now=0.1)
    for t in range(3):
        out, _ = tick(s, 0.1 + t)
        assert out.scheduled_ids == ["low"]
    assert s.preemptions == 0 and s.num_paused == 0


def test_paused_requests_go_on_when_nothing_else_can_start():
    """A paused request holds its slots: when the request it was paused for
    cannot start after all, it resumes instead of leaving the engine idle."""
    s = step_scheduler(seats=1)
    s.add_request(req("low", steps=20, priority=2), now=0.0)
    tick(s)
    s.add_request(req("mid", steps=20, priority=1), now=0.1)
    tick(s, 0.1)  # low paused for mid
    assert s.record("low").status is RequestStatus.PAUSED
    s.abort("mid")
    s.adapters = Slots()
    s.add_request(req("lora-urgent", steps=5), now=0.2)  # cannot start
    out, _ = tick(s, 0.2)
    assert out.scheduled_ids == ["low"] and out.new == [] and s.num_paused == 0


def test_a_more_urgent_request_of_another_key_pauses_the_batch_or_drains_it():
    keyed = lambda r: (r.sampling_params.height,)  # noqa: E731  (sizes do not mix here)
    s = StepScheduler(3, make_policy("slo", aging_ticks=100, cost=Cost()), key=keyed,
                      tokens=shape, max_paused_bytes=1 << 30)
    s.add_request(req("a", size=64, steps=20, priority=1), now=0.0)
    s.add_request(req("b", size=64, steps=20, priority=2), now=0.0)
    tick(s)
    s.add_request(req("other", size=32, steps=3), now=0.1)  # more urgent than the whole batch
    out, _ = tick(s, 0.1)
    assert [r.request_id for r in out.new] == ["other"] and out.scheduled_ids == ["other"]
    assert s.num_paused == 2 and s.preemptions == 2
    # not more urgent than everything running: no pause, but the less urgent
    # of the running key stop joining, so the batch drains for it
    d = StepScheduler(3, make_policy("slo", aging_ticks=100, cost=Cost()), key=keyed,
                      tokens=shape, max_paused_bytes=1 << 30)
    d.add_request(req("urgent", size=64, steps=20), now=0.0)
    tick(d)
    d.add_request(req("other", size=32, steps=3), now=0.1)
    d.add_request(req("late-low", size=64, steps=3, priority=1), now=0.1)
    d.add_request(req("late-equal", size=64, steps=3), now=0.1)
    out, _ = tick(d, 0.1)
    assert out.scheduled_ids == ["urgent", "late-equal"] and d.preemptions == 0
    assert d.record("late-low").status is RequestStatus.WAITING


def test_lateness_leaves_out_the_running_requests_it_would_pause():
    s = step_scheduler(seats=1, cost=Cost(per_unit=0.01))  # 64 px: 0.64 s a step
    s.add_request(req("long", steps=100), now=0.0)  # priority 0
    tick(s)
    from diffrt.engine.record import RequestRecord
    same = RequestRecord(req("same-class", steps=2, deadline_s=5.0), arrival=0.0)
    urgent = RequestRecord(req("urgent", steps=2, deadline_s=5.0, priority=-1), arrival=0.0)
    assert s.lateness(same, 0.0) > 0  # behind 99 steps of "long"
    assert s.lateness(urgent, 0.0) < 0  # it would pause "long"
    s.max_paused_bytes = 0  # no preemption: "long" is ahead of it too
    assert s.lateness(urgent, 0.0) > 0


def test_only_ticks_that_ran_age_the_waiting():
    s = step_scheduler(seats=1)
    s.add_request(req("a", steps=3), now=0.0)
    s.add_request(req("b", steps=3), now=0.0)
    out = s.schedule(0.0)
    assert s.record("b").waited_ticks == 1
    assert s.schedule(0.0) is None  # in flight: no tick
    assert s.record("b").waited_ticks == 1
    s.update_from_output(out, ExecutionResult(steps={"a": 1}))


def test_steps_are_kept_short_enough_for_a_deadline_that_can_still_be_met():
    """A step costs 0.001 s a unit (height): 64 + 256 units make 0.32 s
    steps, too slow for the urgent request's 3 steps in 0.5 s; without the
    large less urgent one, 0.064 s steps are in time. The large one is
    paused, and nothing less urgent joins in that tick. A deadline no batch
    can meet protects nobody."""
    s = step_scheduler(seats=4, cost=Cost(per_unit=0.001))
    s.add_request(req("large", size=256, steps=20, priority=1), now=0.0)
    tick(s)
    s.add_request(req("urgent", size=64, steps=3, deadline_s=0.5), now=0.0)
    s.add_request(req("small-late", size=32, steps=3, priority=1), now=0.0)
    out, _ = tick(s, 0.0)
    assert out.scheduled_ids == ["urgent"] and s.record("large").status is RequestStatus.PAUSED
    assert s.record("small-late").status is RequestStatus.WAITING
    hopeless = step_scheduler(seats=4, cost=Cost(per_unit=0.001))
    hopeless.add_request(req("large", size=256, steps=20, priority=1), now=0.0)
    tick(hopeless)
    hopeless.add_request(req("lost", size=64, steps=3, deadline_s=0.1), now=0.0)  # 0.19 s alone
    out, _ = tick(hopeless, 0.0)
    assert out.scheduled_ids == ["large", "lost"] and hopeless.preemptions == 0
