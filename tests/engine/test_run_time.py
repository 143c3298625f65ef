"""The run-time estimate and ``max_request_seconds``: a request's cost is the
seconds it would hold this engine, measured, attention's quadratic term
included; one estimated to run too long is refused naming the estimate."""

from __future__ import annotations

import pytest
from engine_helpers import toy_engine, toy_request

from diffrt.engine import InvalidRequestError
from diffrt.engine.model_spec import ModelSpec, SamplingDefaults
from diffrt.engine.run_time import RunTimeModel


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


def test_the_fit_recovers_overhead_and_rate_from_two_sizes():
    model = RunTimeModel(spec())
    assert model.estimate(req(256)) is None and not model.calibrated
    overhead, per_unit = 0.004, 2e-6
    for size in (128, 256, 512, 128, 512):
        model.observe([req(size)], overhead + per_unit * model.units(req(size)))
    o, k = model.coefficients
    assert o == pytest.approx(overhead) and k == pytest.approx(per_unit)
    assert model.estimate(req(384, steps=30)) == pytest.approx(
        30 * (overhead + per_unit * model.units(req(384))))
    # a tick of two requests is their summed work
    model.observe([req(256), req(256)], overhead + per_unit * 2 * model.units(req(256)))
    assert model.coefficients[1] == pytest.approx(per_unit)
    model.reset()
    assert model.estimate(req(256)) is None


def test_one_size_measured_overestimates_larger_requests():
    """Overhead and rate cannot be told apart from one size: the fit goes
    through the origin, charging the overhead per unit (never too little
    for a larger request: a refusal errs on the side of the others)."""
    model = RunTimeModel(spec())
    overhead, per_unit = 0.01, 1e-6
    true = lambda size: overhead + per_unit * model.units(req(size))  # noqa: E731
    for _ in range(3):
        model.observe([req(128)], true(128))
    assert model.coefficients[0] == 0.0
    for size in (256, 1024, 2048):
        assert model.estimate(req(size, steps=1)) >= true(size)


def test_a_tick_that_also_encoded_prompts_does_not_move_its_size():
    model = RunTimeModel(spec())
    for seconds in (0.010, 0.011, 0.5, 0.010, 0.012):  # 0.5: the tick that encoded
        model.observe([req(256)], seconds)
    for _ in range(3):
        model.observe([req(512)], 0.04)
    assert model.estimate(req(256, steps=1)) < 0.02


def test_many_ticks_of_one_size_do_not_crowd_out_the_others():
    model = RunTimeModel(spec())
    model.observe([req(512)], 0.1)
    for _ in range(1000):
        model.observe([req(128)], 0.005)
    assert model.estimate(req(512, steps=1)) == pytest.approx(0.1, rel=0.05)


def test_a_request_estimated_above_the_limit_is_refused_naming_estimate_and_limit():
    with toy_engine(max_request_seconds=2.0, warmup=False) as engine:
        model = engine.run_time
        model.observe([req(64)], 0.001)  # measured: 1 ms a step at 64 px, 16 ms at 256
        model.observe([req(256)], 0.016)
        # judged before any real tick: those follow the machine's momentary load
        big = toy_request(size=256, steps=100, num_outputs_per_prompt=2)  # ~3.2 s
        with pytest.raises(InvalidRequestError, match=r"would run about 3\.\d+ s on this engine "
                           r"\(256x256, 100 steps, n=2\), above max_request_seconds=2") as info:
            engine.generate(big)
        assert info.value.field == "sampling_params"
        assert engine.is_healthy() and engine.generate(toy_request(size=64, steps=4)).ok


def test_warm_up_calibrates_the_estimate_from_warm_steps():
    with toy_engine() as engine:  # warm-up on
        assert engine.run_time.calibrated
        estimate = lambda size: engine.run_time.estimate(  # noqa: E731
            engine.spec.with_defaults(toy_request(size=size, steps=1000)))
        assert estimate(512) > estimate(64) > 0
    with toy_engine(warmup=False, max_request_seconds=1e-9) as engine:
        # nothing measured yet: nothing refused; the first request's ticks calibrate
        assert engine.generate(toy_request(size=16, steps=2)).ok
        assert engine.run_time.calibrated
        with pytest.raises(InvalidRequestError, match="max_request_seconds"):
            engine.generate(toy_request(size=16, steps=2))


def test_the_start_up_requests_are_never_refused_by_the_limit():
    """The warm-up and calibration requests are the engine's own: a limit no
    request can meet (as a small one is on a busy machine, whose slow steps
    the estimate follows) still lets the engine start, then refuses clients."""
    with toy_engine(max_request_seconds=1e-9) as engine:  # warm-up on
        assert engine.run_time.calibrated and not engine.starting
        with pytest.raises(InvalidRequestError, match="max_request_seconds"):
            engine.generate(toy_request(size=16, steps=2))


@pytest.mark.parametrize("step", [False, True])
def test_both_modes_feed_the_estimate_per_step(step):
    with toy_engine(step_execution=step, max_num_seqs=2, warmup=False) as engine:
        outs = engine.generate([toy_request(size=64, steps=3), toy_request(size=64, steps=3)])
        assert all(out.ok for out in outs)
        overhead, per_unit = engine.run_time.coefficients
        assert overhead == 0.0 and per_unit > 0  # one size seen
