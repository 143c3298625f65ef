"""Step caches through the engine (tiny-flux): requests with different
policies, sizes, step counts, CFG and none share step batches and each
decides as it does alone (the same reused steps, pixels within 1/255); a
fused request-mode batch likewise; the state goes with the request in every
ending; the bound runs a request uncached and says so; what is refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from engine_helpers import assert_clean, shared_engine
from waiting import wait_until

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.runner_messages import CountStepStates
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.submission import accept

#: (height, width, steps, cache, threshold, cfg): none, both policies at two
#: thresholds, sizes and step counts that differ, CFG on two of them; the
#: thresholds sit where tiny-flux's metrics are not within float noise of them
MIX = [(64, 64, 5, None, None, False),
       (64, 64, 6, "first-block", 0.3, True),
       (96, 64, 6, "teacache", 0.5, False),
       (64, 96, 5, "teacache", 0.6, True)]


def request_for(i: int, height: int, width: int, steps: int, cache: str | None,
            threshold: float | None, cfg: bool, prompt: str | None = None) -> DiffusionRequest:
    guidance = {"true_cfg_scale": 3.0} if cfg else {}
    return DiffusionRequest(
        prompt=prompt or f"a red fox {i}", negative_prompt="blurry" if cfg else None,
        sampling_params=SamplingParams(height=height, width=width, num_inference_steps=steps,
                                       seed=i, cache=cache, cache_threshold=threshold,
                                       **guidance))


def pixels(out) -> list[np.ndarray]:
    assert out.ok, out.error
    return [np.asarray(image).astype(np.int16) for image in out.images]


def cache_bytes(engine: DiffusionEngine) -> int:
    return engine.executor.collective_rpc(CountStepStates())[0].cache_bytes


def config(**kw) -> EngineConfig:
    kw.setdefault("step_execution", True)
    return EngineConfig(model="tiny-flux", executor_backend="inproc", max_num_seqs=8,
                        warmup=False, **kw)


@pytest.fixture
def stepped(flux_step_engine):
    """The session's tiny-flux step engine: rows of several sizes in a call
    per size (the CPU default), four requests a step."""
    return flux_step_engine


@pytest.fixture(scope="module")
def padded():
    """Rows of several sizes padded into one call; no warm-up, so no run-time
    limit from its estimate (the abort test runs a long request)."""
    with shared_engine(DiffusionEngine.make_engine(
            config(mixed_rows="padded", share_steps="always"))) as engine:
        yield engine


def test_each_request_of_a_mixed_step_batch_decides_as_it_does_alone(stepped):
    assert_decides_as_alone(stepped)


def test_each_request_decides_as_alone_when_rows_of_several_sizes_share_a_call(padded):
    assert_decides_as_alone(padded)


def assert_decides_as_alone(stepped: DiffusionEngine) -> None:
    """Each request of MIX in one step batch as alone: the same reused steps
    (cached) and pixels within 1/255 (the uncached one too)."""
    alone = [stepped.generate(request_for(i, *shape)) for i, shape in enumerate(MIX)]
    before = stepped.stats().cache_steps_total
    together = stepped.generate([request_for(i, *shape) for i, shape in enumerate(MIX)])
    for got, want, shape in zip(together, alone, MIX, strict=True):
        for a, b in zip(pixels(got), pixels(want), strict=True):
            assert np.abs(a - b).max() <= 1
        if shape[3] is None:
            assert got.metrics.cache is None and want.metrics.cache is None
            continue
        assert got.metrics.cache.policy == shape[3]
        assert got.metrics.cache.steps_reused > 0
        assert got.metrics.cache.reused_steps == want.metrics.cache.reused_steps
        assert got.metrics.cache.steps_computed + got.metrics.cache.steps_reused == shape[2]
    after = stepped.stats().cache_steps_total
    reused = sum(o.metrics.cache.steps_reused for o in together if o.metrics.cache)
    assert sum(n - before.get(k, 0) for k, n in after.items() if k[1] == "reused") == reused
    assert cache_bytes(stepped) == 0
    assert_clean(stepped)


def test_a_cached_request_differs_from_its_uncached_run_and_threshold_zero_does_not(stepped):
    plain = stepped.generate(request_for(7, 64, 64, 6, None, None, False))
    for policy in ("first-block", "teacache"):  # alone, as the uncached run: the same bits
        out = stepped.generate(request_for(7, 64, 64, 6, policy, 0.0, False))
        assert out.metrics.cache.steps_reused == 0
        for a, b in zip(pixels(out), pixels(plain), strict=True):
            assert np.array_equal(a, b)
    cached = stepped.generate(request_for(7, 64, 64, 6, "first-block", 0.5, False))
    assert cached.metrics.cache.steps_reused > 0
    assert any(np.abs(a - b).max() > 1 for a, b in zip(pixels(cached), pixels(plain),
                                                      strict=True))


def test_the_state_goes_with_an_aborted_request(padded):
    stepped = padded
    victim = request_for(8, 64, 64, 400, "first-block", 0.0, False)
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("out", stepped.generate(victim)))
    thread.start()
    assert wait_until(lambda: cache_bytes(stepped) > 0)
    stepped.abort(victim.request_id)
    thread.join(30)
    assert got["out"].aborted
    assert wait_until(lambda: cache_bytes(stepped) == 0)
    assert_clean(stepped)


def test_the_state_goes_with_a_failed_request(padded, monkeypatch):
    stepped = padded
    apply_step = FlowMatchPipeline.apply_step

    def failing(self, state, noise_pred):
        if state.request.prompt == "fail" and state.step == 2:
            raise RuntimeError("injected")
        return apply_step(self, state, noise_pred)

    monkeypatch.setattr(FlowMatchPipeline, "apply_step", failing)
    failed, fine = stepped.generate([
        request_for(9, 64, 64, 6, "first-block", 0.3, False, "fail"),
        request_for(10, 64, 64, 6, "teacache", 0.4, False)])
    assert failed.error and "injected" in failed.error
    assert fine.ok and fine.metrics.cache.steps_reused > 0
    assert cache_bytes(stepped) == 0
    assert_clean(stepped)


def test_a_fused_request_batch_decides_per_request():
    specs = [(64, 64, 8, None, None, True), (64, 64, 8, "first-block", 0.3, True),
             (64, 64, 8, "teacache", 0.4, True)]
    with DiffusionEngine.make_engine(config(step_execution=False)) as engine:
        alone = [engine.generate(request_for(i, *s)) for i, s in enumerate(specs)]
        together = engine.generate([request_for(i, *s) for i, s in enumerate(specs)])
        for got, want in zip(together, alone, strict=True):
            for a, b in zip(pixels(got), pixels(want), strict=True):
                assert np.abs(a - b).max() <= 1
            assert (got.metrics.cache and got.metrics.cache.reused_steps) == (
                want.metrics.cache and want.metrics.cache.reused_steps)
        assert together[1].metrics.cache.steps_reused > 0
        assert together[2].metrics.cache.steps_reused > 0
        assert cache_bytes(engine) == 0


def test_a_request_whose_state_does_not_fit_runs_uncached_and_says_so():
    with DiffusionEngine.make_engine(config(cache_state_bytes=1024)) as engine:
        out = engine.generate(request_for(11, 64, 64, 6, "first-block", 0.5, False))
        plain = engine.generate(request_for(11, 64, 64, 6, None, None, False))
        assert out.metrics.cache.uncached_reason == "cache_state_bytes"
        assert out.metrics.cache.steps_reused == 0 and out.metrics.cache.steps_computed == 6
        for a, b in zip(pixels(out), pixels(plain), strict=True):
            assert np.array_equal(a, b)
        assert engine.stats().cache_uncached_total == {"cache_state_bytes": 1}


@pytest.mark.parametrize(("fields", "field"), [
    ({"cache": "taylorseer"}, "cache"),
    ({"cache": "first-block", "cache_threshold": -0.1}, "cache_threshold"),
    ({"cache": "first-block", "cache_threshold": float("nan")}, "cache_threshold"),
    ({"cache": "teacache", "cache_threshold": float("inf")}, "cache_threshold"),
    ({"cache": "off", "cache_threshold": 0.2}, "cache_threshold"),
    ({"cache_threshold": 0.2}, "cache_threshold"),  # tiny-flux has no default cache
])
def test_bad_cache_fields_are_refused_naming_them(stepped, fields, field):
    with pytest.raises(InvalidRequestError) as err:
        stepped.generate(DiffusionRequest("p", sampling_params=SamplingParams(**fields)))
    assert err.value.field == field


def test_caches_are_refused_where_ranks_share_a_requests_rows(stepped):
    parallel = EngineConfig(model="tiny-flux", executor_backend="mp", cfg_parallel_size=2,
                            world_size=2)
    with pytest.raises(InvalidRequestError) as err:
        accept(DiffusionRequest("p", sampling_params=SamplingParams(cache="teacache")),
               stepped.spec, parallel)
    assert err.value.field == "cache"


def test_a_model_without_caches_refuses_them():
    from engine_helpers import toy_engine

    with toy_engine() as engine, pytest.raises(InvalidRequestError) as err:
        engine.generate(DiffusionRequest("p", sampling_params=SamplingParams(
            height=16, width=16, num_inference_steps=2, cache="first-block")))
    assert err.value.field == "cache"
