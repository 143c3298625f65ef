"""engine.stats(): queue gauges, outcome counters and histograms, and the
workers' text-encoding counters (what the server's /metrics and the bench's
text-encoding columns read)."""

from __future__ import annotations

import threading

import engine_toy
import pytest
from engine_helpers import toy_engine, toy_request
from waiting import wait_until

from diffrt.engine import DiffusionRequest, SamplingParams
from diffrt.engine.stats import REQUEST_BUCKETS_S, Histogram, StatsRecorder


def test_histogram_buckets_are_prometheus_shaped():
    recorder = StatsRecorder()
    for value in (0.0, 0.01, 0.011, 1e9):
        recorder.on_tick(value, None)
    h = recorder.snapshot(waiting=0, running=0, pending_output_bytes=0, healthy=True).step_time_s
    assert isinstance(h, Histogram) and len(h.counts) == len(h.bounds) + 1
    # bounds are inclusive upper limits (Prometheus "le"): 0.01 lands in the 0.01 bucket
    by_bound = dict(zip((*h.bounds, float("inf")), h.counts, strict=True))
    assert by_bound[0.001] == 1 and by_bound[0.01] == 1 and by_bound[0.025] == 1
    assert by_bound[float("inf")] == 1 and h.count == 4 and h.sum == pytest.approx(1e9 + 0.021)


@pytest.mark.parametrize("step", [False, True])
def test_gauges_and_outcomes(step):
    # one step per call: the step-time count below follows the calls exactly
    # (a multi-step tick counts once per step it ran: tested below)
    with toy_engine(step_execution=step, max_num_seqs=1, warmup=False,
                    max_steps_per_tick=1) as engine:
        base = engine.stats()
        assert base.requests_total == {"success": 0, "error": 0, "aborted": 0, "timeout": 0}
        assert base.requests_waiting == base.requests_running == 0 and base.healthy
        gate = engine_toy.gate("stats")
        gate.clear()
        blocked = toy_request("block:stats", steps=2, timeout_s=0.5)
        queued, aborted = toy_request(steps=2), toy_request(steps=2)
        results = {}
        runner = threading.Thread(target=lambda: results.update(
            out=engine.generate([blocked, queued, aborted], timeout=30)))
        runner.start()
        assert wait_until(lambda: engine.stats().requests_running == 1
                          and engine.stats().requests_waiting == 2)
        engine.abort(aborted.request_id)
        assert wait_until(lambda: engine.stats().requests_waiting == 1)
        # the blocked request passes its own 0.5 s timeout; the gate opens after it
        assert wait_until(lambda: engine.stats().requests_total["timeout"] == 1)
        gate.set()
        runner.join(30)
        assert not runner.is_alive()
        engine.generate(toy_request("fail"))
        stats = engine.stats()
        assert stats.requests_total == {"success": 1, "error": 1, "aborted": 1, "timeout": 1}
        assert stats.requests_waiting == stats.requests_running == 0
        assert stats.request_latency_s.count == 4 and stats.request_latency_s.bounds == REQUEST_BUCKETS_S
        # admitted to a batch: the blocked, the queued and the failing request
        # (the aborted one never was)
        assert stats.queue_wait_s.count == 3
        assert stats.output_wait_s.count == 1  # only the success had an output to move
        # one per tick that ran: request mode, the forwards of the blocked, the
        # queued and the failing request; step mode, the blocked request's step,
        # the queued one's two, and the tick whose admission failed
        assert stats.step_time_s.count == (4 if step else 3) and stats.step_time_s.sum > 0
    assert not engine.stats().healthy


def test_the_warmup_request_is_not_counted():
    with toy_engine(max_num_seqs=1) as engine:  # warm-up on
        stats = engine.stats()
        assert sum(stats.requests_total.values()) == 0
        assert stats.request_latency_s.count == stats.step_time_s.count == 0


def _flux(prompt: str, seed: int) -> DiffusionRequest:
    return DiffusionRequest(prompt, SamplingParams(height=64, width=64, num_inference_steps=2,
                                                   seed=seed))


def test_text_encoding_is_counted_per_prompt(flux_step_engine):
    engine = flux_step_engine
    before = engine.stats().text_encoding
    # prompts no other test uses: the engine (and its prompt cache) is shared
    outs = engine.generate([_flux("a stats fox", 1), _flux("a stats fox", 2),
                            _flux("a stats owl", 3)])
    assert all(o.ok for o in outs)
    delta = engine.stats().text_encoding - before
    # one call for the tick: two distinct prompts encoded, the repeat answered by the cache
    assert (delta.encoded, delta.cache_hits) == (2, 1) and delta.seconds > 0
    before = engine.stats().text_encoding
    # true CFG with a negative prompt: the negative is a prompt of its own
    out = engine.generate(DiffusionRequest(
        "a stats owl", SamplingParams(height=64, width=64, num_inference_steps=2, seed=4,
                                      true_cfg_scale=2.0), negative_prompt="a stats blur"))
    assert out.ok, out.error
    delta = engine.stats().text_encoding - before
    assert (delta.encoded, delta.cache_hits) == (1, 1)


def test_a_multi_step_tick_counts_once_per_step():
    """step_time_s is per denoise step: a tick that ran 3 steps adds 3
    observations of a third of its time each."""
    with toy_engine(step_execution=True, max_num_seqs=1, warmup=False,
                    max_steps_per_tick=3) as engine:
        assert engine.generate(toy_request(steps=3)).ok
        stats = engine.stats()
        assert stats.step_time_s.count == 3
