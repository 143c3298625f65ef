"""The share/split decision (``sched/share.py``): rows of another size join
a step only when the step-cost model, fitted from ticks, predicts sharing
finishes the requests sooner and pushes none past its deadline. A per-call
overhead injected into the measured ticks (standing in for kernel launches)
turns sharing on where one call takes every row (``packed``, ``padded``); with
none, or a call per size (``by_size``, the CPU's), it stays off; a refused
request is passed at most ``max_bypass`` times."""

from __future__ import annotations

import pytest
from sched_helpers import req as plain

from diffrt.engine.model_spec import ModelSpec, SamplingDefaults
from diffrt.engine.record import RequestRecord
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.sched import ExecutionResult, StepScheduler, make_policy
from diffrt.engine.sched.share import ShareDecider

#: a CPU-like machine: seconds a token and a token squared (attention at its
#: flops ratio to the layers for the spec's width, 1 / (6 x 64)), a small tick cost
WORK = {"call": 0.0, "token": 2e-5, "attention": 2e-5 / (6 * 64), "adapter_token": 0.0,
        "tick": 5e-4, "encode": 0.0, "decode": 0.0}


def req(rid: str, size: int, steps: int = 8, **kw):
    """A request as the engine holds it (the model's defaults filled in)."""
    return spec().with_defaults(plain(rid, size=size, steps=steps, **kw))


def spec() -> ModelSpec:
    return ModelSpec(name="m", family="f", pipeline="m:P", size_multiple=16, max_size=2048,
                     defaults=SamplingDefaults(height=256, width=256, num_inference_steps=8,
                                               guidance_scale=1.0),
                     transformer_width=64)


def fitted(arrangement: str, per_call_s: float) -> RunTimeModel:
    """A model fitted from ticks of a machine with ``WORK`` plus
    ``per_call_s`` a transformer call (the injected overhead)."""
    truth = RunTimeModel(spec(), arrangement=arrangement)
    truth.idle = {**WORK, "call": per_call_s}
    model = RunTimeModel(spec(), arrangement=arrangement)
    sizes = (128, 256, 512)
    for i in range(120):
        batch = [req(f"r{i}", size=sizes[i % 3])] * (1 + i % 2)
        if i % 4 == 0:
            batch.append(req(f"o{i}", size=sizes[(i + 1) % 3]))
        steps = 1 + i % 3
        model.observe_tick(batch, steps, steps * truth.step_seconds(batch, idle=True)
                           + truth.idle["tick"])
    return model


def record(rid: str, size: int, steps: int = 8, seq: int = 0, **kw) -> RequestRecord:
    return RequestRecord(req(rid, size=size, steps=steps, **kw), arrival=0.0, seq=seq)


def decider(model: RunTimeModel, max_bypass: int = 2) -> ShareDecider:
    return ShareDecider(model, lambda r: (r.sampling_params.height,), max_bypass=max_bypass)


@pytest.mark.parametrize("arrangement", ["by_size", "packed", "padded"])
def test_without_a_per_call_overhead_sizes_run_apart(arrangement):
    share = decider(fitted(arrangement, per_call_s=0.0))
    for running, joining in ((512, 128), (128, 512), (256, 256 + 16)):
        decision = share.decide([record("b", running)], record("c", joining), now=0.0)
        assert not decision.shared, decision.explain()


@pytest.mark.parametrize("arrangement", ["packed", "padded"])
def test_a_per_call_overhead_turns_sharing_on_where_one_call_takes_every_row(arrangement):
    share = decider(fitted(arrangement, per_call_s=0.010))
    decision = share.decide([record("b", 128), record("b2", 128)], record("c", 64), now=0.0)
    assert decision.shared, decision.explain()
    assert "together" in decision.explain() and share.shared == 1


def test_a_call_per_size_gains_nothing_from_a_per_call_overhead():
    share = decider(fitted("by_size", per_call_s=0.010))
    assert not share.decide([record("b", 128)], record("c", 64), now=0.0).shared


def test_sharing_never_pushes_a_request_past_its_deadline():
    model = fitted("packed", per_call_s=0.010)
    share = decider(model)
    batch = [record("b", 128)]
    alone = model.step_seconds([batch[0].request]) + model.tick_seconds
    # due just after its run alone: the shared step's extra time would make it late
    tight = record("t", 128, deadline_s=8 * alone * 1.001)
    decision = share.decide([tight], record("c", 64), now=0.0)
    assert not decision.shared and "deadline" in decision.reason
    assert share.decide(batch, record("c", 64), now=0.0).shared


def test_the_scheduler_keeps_a_refused_size_waiting_at_most_max_bypass_rounds():
    share = decider(fitted("by_size", per_call_s=0.0), max_bypass=2)
    s = StepScheduler(8, make_policy("skip_ahead"), key=lambda r: (), share=share)
    s.add_request(req("big", size=512, steps=20), now=0.0)
    out = s.schedule(now=0.0)
    assert out.scheduled_ids == ["big"]
    s.add_request(req("small", size=64, steps=20), now=0.0)  # as long: apart is sooner
    ids = ["big"]
    for round_ in range(3):  # a same-size request arrives behind it each round
        s.add_request(req(f"big{round_}", size=512, steps=20), now=0.0)
        s.update_from_output(out, ExecutionResult(steps={rid: 1 for rid in out.scheduled_ids}))
        out = s.schedule(now=0.0)
        ids = out.scheduled_ids
        if round_ < 2:
            assert "small" not in ids and f"big{round_}" in ids  # split: it waits
    # passed twice: it now blocks the third, which waits with it for the batch to drain
    assert "big2" not in ids and "small" not in ids
    assert share.split >= 3 and any("small" in d.explain() for d in share.log)


def test_a_short_request_beside_a_long_one_shares_even_by_size():
    """Apart, a 2-step request waits for a 20-step batch to drain; sharing
    finishes it 18 steps sooner at the price of 2 slower steps of the batch."""
    share = decider(fitted("by_size", per_call_s=0.0))
    assert share.decide([record("long", 512, steps=20)], record("short", 64, steps=2),
                        now=0.0).shared


def test_by_size_a_short_request_joins_only_where_the_batch_barely_slows():
    """A call per size saves nothing, so the engine's decider by ``by_size``
    protects the batch: a short request of about the batch's size, which
    the summed completion times would let join, runs apart (joining, it
    would slow each of the batch's steps about twofold); a far smaller one
    still joins (the batch's rows finish within the margin of apart)."""
    model = fitted("by_size", per_call_s=0.0)
    free = decider(model)
    guarded = ShareDecider(model, lambda r: (r.sampling_params.height,), protect_batch=True)
    batch, short = [record("long", 256, steps=20)], record("short", 272, steps=4)
    assert free.decide(batch, short, now=0.0).shared  # the sum gains: it joins unguarded
    refused = guarded.decide(batch, short, now=0.0)
    assert not refused.shared and "long would finish later" in refused.reason
    assert guarded.decide([record("long", 512, steps=20)], record("short", 64, steps=2),
                          now=0.0).shared


def test_the_engine_guards_the_batch_by_size_only():
    from diffrt.engine import DiffusionEngine, EngineConfig

    for rows, guarded in (("by_size", True), ("packed", False)):
        with DiffusionEngine.make_engine(EngineConfig(
                model="tiny-flux", executor_backend="inproc", step_execution=True,
                warmup=False, mixed_rows=rows)) as engine:
            assert engine.scheduler.share.protect_batch is guarded


def test_an_engine_that_keeps_sizes_apart_decides_no_sharing():
    """``share_steps="cost"`` decides only where sizes may mix: a keyed
    engine (``mixed_size_batching=False``) gets no decider, so rows that
    differ only in adapters or caches still share its steps."""
    from diffrt.engine.assembly import make_scheduler, run_time_model
    from diffrt.engine.config import EngineConfig
    from diffrt.engine.lora.registry import AdapterRegistry
    from diffrt.engine.models.registry import resolve_model_spec

    spec = resolve_model_spec("tiny-flux")
    for mixing, decides in ((True, True), (False, False)):
        config = EngineConfig(model="tiny-flux", step_execution=True,
                              mixed_size_batching=mixing)
        scheduler = make_scheduler(config, spec, run_time_model(config, spec)[0], None,
                                   AdapterRegistry(1, accepts_adapters=True, model=spec.name))
        assert (scheduler.share is not None) is decides


def classed(model: RunTimeModel) -> ShareDecider:
    """A decider that knows the requests' classes (their priority, the
    ``slo`` policy's without aging)."""
    return ShareDecider(model, lambda r: (r.sampling_params.height,),
                        urgency=lambda record: record.request.sampling_params.priority)


def test_a_lower_class_never_slows_a_higher_ones_steps():
    """Where sharing pays in the sum (one call over every row, 10 ms a
    call), an urgent request still runs apart: joined by less urgent rows,
    or joining them where the scheduler would pause them for it."""
    model = fitted("packed", per_call_s=0.010)
    batch = [record("b", 128, priority=5), record("b2", 128, priority=5)]
    urgent = record("c", 64, priority=0)
    assert decider(model).decide(batch, urgent, now=0.0).shared  # classes unknown: shared
    share = classed(model)
    joining = share.decide(batch, urgent, now=0.0, preempting=True)
    assert not joining.shared and "ranks above the batch" in joining.reason
    joined = share.decide([urgent], record("b", 128, priority=5), now=0.0)
    assert not joined.shared and "c ranks above it" in joined.reason
    # one class: the sum decides, as without classes
    assert share.decide(batch, record("c", 64, priority=5), now=0.0, preempting=True).shared


def test_an_urgent_request_of_another_size_pauses_the_batch_and_runs_alone():
    """On a machine where sizes share steps (``packed``, 10 ms a call), an
    urgent small request does not join running large ones: they are paused
    at the step boundary, it runs alone, and they rejoin after it."""
    share = classed(fitted("packed", per_call_s=0.010))
    s = StepScheduler(4, make_policy("slo", aging_ticks=1000), key=lambda r: (), share=share,
                      max_paused_bytes=1 << 30)
    for i in range(3):
        s.add_request(req(f"clip{i}", size=512, steps=20, priority=5), now=0.0)
    out = s.schedule(now=0.0)
    assert sorted(out.scheduled_ids) == ["clip0", "clip1", "clip2"]
    s.add_request(req("image", size=64, steps=3, priority=0), now=0.0)
    ran = []
    for _ in range(6):
        s.update_from_output(out, ExecutionResult(
            steps={rid: s.record(rid).step + 1 for rid in out.scheduled_ids},
            finished=[rid for rid in out.scheduled_ids if s.record(rid).step + 1 == 20
                      or rid == "image" and s.record(rid).step + 1 == 3],
            state_bytes={rid: 100 for rid in out.scheduled_ids}))
        out = s.schedule(now=0.0)
        ran.append(sorted(out.scheduled_ids))
    assert ran[:3] == [["image"]] * 3 and s.preemptions == 3
    assert ran[3] == ["clip0", "clip1", "clip2"]  # back, from the step they had reached
    assert any("ranks above" in d.reason for d in share.log)
