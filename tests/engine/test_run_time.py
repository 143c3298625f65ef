"""The run-time estimate and ``max_request_seconds``: a request's cost is the
seconds it would hold this engine by the step-cost model, attention's
quadratic term included; one estimated to run too long at the calibrated
idle speed is refused naming the estimate; the model persists across starts."""

from __future__ import annotations

import pytest
from engine_helpers import toy_engine, toy_request

from diffrt.engine import InvalidRequestError
from diffrt.engine.model_spec import ModelSpec, SamplingDefaults
from diffrt.engine.run_time import FEATURES, RunTimeModel


def spec(width: int = 64, text_tokens: int = 0) -> ModelSpec:
    return ModelSpec(name="m", family="f", pipeline="m:P", size_multiple=16, max_size=2048,
                     defaults=SamplingDefaults(height=256, width=256, num_inference_steps=4,
                                               guidance_scale=1.0),
                     transformer_width=width, text_tokens=text_tokens)


def req(size: int, steps: int = 10, n: int = 1, guidance: float = 1.0):
    return toy_request(size=size, steps=steps, num_outputs_per_prompt=n, guidance_scale=guidance)


def test_work_grows_with_attention_quadratic_term_rows_and_text():
    model = RunTimeModel(spec(width=64))
    small, large = model.units(req(256)), model.units(req(512))
    # 4x the tokens: 4x the linear work, 16x the attention work
    assert large > 4 * small
    tokens = (512 // 16) ** 2
    assert large == pytest.approx(tokens * (1 + tokens / (6 * 64)))
    assert RunTimeModel(spec(width=0)).units(req(512)) == 4 * RunTimeModel(
        spec(width=0)).units(req(256))  # no width known: linear
    assert model.units(req(256, n=3)) == 3 * small
    assert model.units(req(256, guidance=2.0)) == 2 * small  # CFG: two rows an output
    with_text = RunTimeModel(spec(width=64, text_tokens=77))
    assert with_text.spec.row_tokens(req(256)) == (256 // 16) ** 2 + 77


COEFFICIENTS = {"call": 0.004, "token": 2e-6, "attention": 1e-9, "adapter_token": 0.0,
                "tick": 0.002, "encode": 0.01, "decode": 1e-6}


def test_a_request_estimate_is_its_steps_ticks_encoding_and_decode():
    model = RunTimeModel(spec(), steps_per_tick=4)
    assert model.estimate(req(256)) is None and not model.calibrated
    model.idle = dict(COEFFICIENTS)
    tokens = (256 // 16) ** 2
    step = 0.004 + 2e-6 * tokens + 1e-9 * tokens**2
    assert model.estimate(req(256, steps=10)) == pytest.approx(
        10 * step + 3 * 0.002 + 0.01 + 1e-6 * tokens)  # 3 ticks of up to 4 steps
    assert model.estimate(req(256, steps=10, n=2)) > model.estimate(req(256, steps=10))


def test_the_fit_recovers_known_coefficients_from_ticks():
    model = RunTimeModel(spec(), steps_per_tick=4)
    truth = RunTimeModel(spec(), steps_per_tick=4)
    truth.idle = dict(COEFFICIENTS)
    for i in range(60):
        size = (128, 256, 512)[i % 3]
        batch = [req(size)] * (1 + i % 2) + ([req(384)] if i % 5 == 0 else [])
        steps = 1 + i % 4
        seconds = (steps * truth.step_seconds(batch, idle=True) + COEFFICIENTS["tick"]
                   + COEFFICIENTS["encode"] * (i % 3 == 0))
        model.observe_tick(batch, steps, seconds, new=int(i % 3 == 0))
    for size in (128, 384, 512):
        assert model.estimate(req(size, steps=30), idle=False) == pytest.approx(
            truth.estimate(req(size, steps=30)), rel=0.05)
    assert model.online.error()[0] < 0.05
    model.reset()
    assert model.estimate(req(256)) is None


def test_a_request_estimated_above_the_limit_is_refused_naming_estimate_and_limit(
        monkeypatch, tmp_path):
    with toy_engine(max_request_seconds=2.0, warmup=False) as engine:
        model = engine.run_time
        model.idle = {**dict.fromkeys(COEFFICIENTS, 0.0), "token": 1e-5}
        big = toy_request(size=256, steps=100, num_outputs_per_prompt=2)
        with pytest.raises(InvalidRequestError, match=r"would run about \d\.\d+ s on this engine "
                           r"\(256x256, 100 steps, n=2\), above max_request_seconds=2") as info:
            engine.generate(big)
        assert info.value.field == "sampling_params"
        assert engine.is_healthy() and engine.generate(toy_request(size=64, steps=4)).ok


def test_the_limit_is_judged_at_the_idle_speed_not_under_load(monkeypatch, tmp_path):
    """Ticks measured on a loaded machine (injected: ten times the idle
    step times) move the online fit, not the limit's verdict: the request
    admitted idle is admitted loaded (the online estimate would refuse it),
    and the one refused idle is refused loaded."""
    admitted = lambda: toy_request(size=64, steps=100)  # noqa: E731
    refused = lambda: toy_request(size=64, steps=1000)  # noqa: E731
    with toy_engine(warmup=False) as engine:
        # the toy's steps cost nothing to speak of: an idle model of known steps, persisted
        engine.run_time.idle = dict(COEFFICIENTS)
        engine.save_costs()
        idle = engine.run_time.estimate(engine.spec.with_defaults(admitted()))
        limit = engine.run_time.estimate(engine.spec.with_defaults(refused())) / 2
    assert idle < limit / 4
    with toy_engine(max_request_seconds=limit, warmup=False) as engine:
        model, spec = engine.run_time, engine.spec
        assert model.restored and model.estimate(spec.with_defaults(admitted())) == idle
        for i in range(200):  # a loaded machine: every tick ten times the idle speed's
            batch = [spec.with_defaults(toy_request(size=(64, 128)[i % 2], steps=4))]
            model.observe_tick(batch, 1 + i % 4, 10 * (
                (1 + i % 4) * model.step_seconds(batch, idle=True) + model.idle["tick"]))
        assert model.estimate(spec.with_defaults(admitted()), idle=False) > limit
        assert model.estimate(spec.with_defaults(admitted())) == idle
        assert engine.generate(admitted()).ok
        with pytest.raises(InvalidRequestError, match="max_request_seconds"):
            engine.generate(refused())


def test_warm_up_calibrates_the_estimate_from_warm_steps(monkeypatch, tmp_path):
    with toy_engine() as engine:  # warm-up on
        assert engine.run_time.calibrated and engine.run_time.idle is not None
        estimate = lambda size: engine.run_time.estimate(  # noqa: E731
            engine.spec.with_defaults(toy_request(size=size, steps=1000)))
        # the toy's steps barely grow with size: the fit may charge them per step
        assert estimate(512) >= estimate(64) > 0
    monkeypatch.setenv("DIFFRT_STEP_COST_DIR", str(tmp_path / "other"))
    with toy_engine(warmup=False, max_request_seconds=1e-9) as engine:
        # nothing measured yet: nothing refused; the first request's ticks calibrate
        assert engine.generate(toy_request(size=16, steps=2)).ok
        assert engine.run_time.calibrated
        with pytest.raises(InvalidRequestError, match="max_request_seconds"):
            engine.generate(toy_request(size=16, steps=2))


def test_a_restart_starts_calibrated_from_the_persisted_model(monkeypatch, tmp_path):
    """The idle model persists per (device, model folder, dtype, settings):
    a restart reads it before any tick; other settings do not."""
    with toy_engine() as engine:
        idle = dict(engine.run_time.idle)
    with toy_engine(warmup=False) as engine:
        assert engine.run_time.restored and engine.run_time.idle == idle
        assert engine.run_time.online.coefficients is not None  # seeded: calibrated before a tick
    with toy_engine(warmup=False, mixed_rows="padded") as engine:
        assert engine.run_time.idle is None  # another arrangement: another model


def test_the_model_shows_in_stats_metrics_and_the_env_check_listing(monkeypatch, tmp_path):
    """``stats()`` and ``/metrics`` carry the coefficients (online and idle)
    and the recent prediction error; ``cost_store.persisted`` (what ``diffrt
    env --check`` prints) lists the model saved."""
    from prometheus_client import generate_latest

    from diffrt.engine import cost_store
    from diffrt.serve.metrics import ServerMetrics

    with toy_engine() as engine:
        assert engine.generate(toy_request(size=64, steps=4)).ok
        stats = engine.stats()
        assert set(stats.step_cost) == set(stats.step_cost_idle) == set(FEATURES)
        assert stats.step_cost_error is not None and 0 <= stats.step_cost_error[0]
        text = generate_latest(ServerMetrics(lambda: [({}, stats)]).registry).decode()
        assert 'diffrt_step_cost_coefficient{model="idle",term="token"}' in text
        assert 'diffrt_step_cost_error{quantile="0.9"}' in text
    (listed,) = cost_store.persisted()
    assert listed["key"] == engine.cost_key and listed["model"] == "toy"
    assert listed["idle"] == stats.step_cost_idle


def test_the_start_up_requests_are_never_refused_by_the_limit(monkeypatch, tmp_path):
    """The warm-up and calibration requests are the engine's own: a limit no
    request can meet still lets the engine start, then refuses clients."""
    with toy_engine(max_request_seconds=1e-9) as engine:  # warm-up on
        assert engine.run_time.calibrated and not engine.starting
        with pytest.raises(InvalidRequestError, match="max_request_seconds"):
            engine.generate(toy_request(size=16, steps=2))


@pytest.mark.parametrize("step", [False, True])
def test_both_modes_feed_the_estimate_per_step(step):
    with toy_engine(step_execution=step, max_num_seqs=2, warmup=False) as engine:
        outs = engine.generate([toy_request(size=64, steps=3), toy_request(size=64, steps=3)])
        assert all(out.ok for out in outs)
        assert engine.run_time.online.ticks > 0 and engine.run_time.coefficients["token"] >= 0


def test_the_calibration_measures_three_sizes_far_enough_apart():
    """Three sizes (a fixed cost, a per-token and an attention term): the
    second with twice the first's work, the third with four times the
    second's and attention a third of its flops, left undecoded; fewer where
    the model's largest size comes first or it serves no latents."""
    from diffrt.engine.run_time import ATTENTION_TOKENS_PER_WIDTH
    from diffrt.engine.start_up import (
        CALIBRATION_TICKS,
        CALIBRATION_WORK_RATIO,
        LARGEST_TICKS,
        LARGEST_WORK_RATIO,
        calibration_requests,
    )

    m = spec(width=32, text_tokens=512)
    model = RunTimeModel(m)
    requests = [m.with_defaults(r) for r in calibration_requests(m, model, max_steps_per_tick=4)]
    sides = [r.sampling_params.height for r in requests]
    assert sides[0] == m.warmup_size() and sides == sorted(set(sides)) and len(sides) == 3
    work = [model.units(r) for r in requests]
    assert work[1] >= CALIBRATION_WORK_RATIO * work[0]
    assert work[2] >= LARGEST_WORK_RATIO * work[1]
    assert m.row_tokens(requests[2]) >= ATTENTION_TOKENS_PER_WIDTH * 32
    assert [r.sampling_params.num_inference_steps for r in requests] == [
        CALIBRATION_TICKS * 4, CALIBRATION_TICKS * 4, LARGEST_TICKS * 4]
    assert len({r.prompt for r in requests}) == 3  # no prompt cache hit spares an encoding
    # the largest is not decoded (its decode would cost more than its steps): no decode counted
    assert [r.sampling_params.output_type for r in requests] == ["np", "np", "latent"]
    assert model.decoded_tokens(requests[2]) == 0 < model.decoded_tokens(requests[1])
    with_sound = ModelSpec(name="m", family="f", pipeline="m:P", size_multiple=16,
                           max_size=2048, defaults=m.defaults, transformer_width=32, sound=True)
    assert len(calibration_requests(with_sound, RunTimeModel(with_sound), 1)) == 2  # no latents
    small = ModelSpec(name="m", family="f", pipeline="m:P", size_multiple=16, max_size=96,
                      defaults=m.defaults, transformer_width=32)
    assert [r.sampling_params.height for r in calibration_requests(
        small, RunTimeModel(small), 1)] == [64, 96]  # capped: the largest side, once


@pytest.mark.parametrize("prices", [True, False])
def test_a_calibration_whose_fit_prices_no_size_is_measured_again(monkeypatch, prices):
    """A stalled tick on a busy machine can leave the calibration's fit with
    no slope (every size priced like the smallest): its requests run once
    more (``CALIBRATION_ROUNDS`` in all), each with a prompt of its own."""
    import engine_toy

    from diffrt.engine.start_up import CALIBRATION_ROUNDS, calibration_requests

    monkeypatch.setattr(RunTimeModel, "refit", lambda self: prices)
    engine_toy.reset()
    with toy_engine() as engine:  # warm-up on
        ran = {i for kind in ("forward", "step") for call in engine_toy.calls(kind)
               for i in call if i.startswith("calibrate-")}
        per_round = len(calibration_requests(engine.spec, engine.run_time,
                                             engine.config.scheduling.max_steps_per_tick))
    assert len(ran) == per_round * (1 if prices else CALIBRATION_ROUNDS)
