"""Video paused for an image (issue 50): on a tiny-wan step engine with the
``slo`` policy and the default ``share_steps="cost"``, a one-frame request
of priority 0 that arrives while clips of priority 5 run does not share
their steps: every clip is paused at the next step boundary, the image runs
alone and finishes first, and the clips go on from the steps they had
reached, their frames within 1/255 of their uninterrupted runs. The share
decision prices steps with a fixed model of a CPU (``RowsCost``)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
from engine_helpers import assert_clean, assert_no_step_states, shared_engine
from waiting import wait_until

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

pytest.importorskip("diffusers")

CLIP_STEPS = 20


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model="tiny-wan", executor_backend="inproc", step_execution=True,
                          max_num_seqs=4, max_steps_per_tick=1, scheduling_policy="slo",
                          slo_aging_ticks=1000, max_request_seconds=None)
    with shared_engine(DiffusionEngine.make_engine(config)) as engine:
        yield engine


def request(rid: str, seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt=f"a red fox {seed}", request_id=rid,
                            sampling_params=SamplingParams(seed=seed, **params))


def frames(out) -> np.ndarray:
    assert out.ok, out.error
    return np.stack([np.asarray(f) for f in out.frames[0]]).astype(np.int16)


class RowsCost:
    """A machine whose step grows with its rows' pixels (a CPU's, by size):
    the share decision's cost model here, so what it decides does not hang
    on how this run's calibration split the engine's fit (a fit with no
    per-token term would price sharing as free, and sharing is then right)."""

    tick_seconds = 1e-4

    def step_seconds(self, requests) -> float:
        return sum(1e-3 + 1e-7 * (r.sampling_params.num_frames or 1) * r.sampling_params.height
                   * r.sampling_params.width for r in requests)


def test_clips_pause_for_an_urgent_image_and_resume_with_their_own_frames(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.share, "cost", RowsCost())
    clips = {"clip-a": 1, "clip-b": 2}
    image = dict(num_frames=1, height=32, width=32, num_inference_steps=3)
    alone = {rid: frames(engine.generate(request(f"{rid}-solo", seed,
                                                 num_inference_steps=CLIP_STEPS)))
             for rid, seed in clips.items()}
    alone["image"] = frames(engine.generate(request("image-solo", 3, **image)))
    scheduler = engine.scheduler
    ticks: list[list[str]] = []
    schedule = scheduler.schedule

    def logged(now: float):
        out = schedule(now)
        if out is not None and out.scheduled_ids:
            ticks.append(list(out.scheduled_ids))
        return out

    scheduler.schedule = logged  # type: ignore[method-assign]
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            running = {rid: pool.submit(engine.generate, request(
                rid, seed, num_inference_steps=CLIP_STEPS, priority=5))
                for rid, seed in clips.items()}
            assert wait_until(lambda: all((r := scheduler.record(rid)) is not None and r.step >= 2
                                          for rid in clips))
            urgent = pool.submit(engine.generate, request("image", 3, priority=0, **image))
            outs = {rid: f.result(timeout=120) for rid, f in (*running.items(),
                                                              ("image", urgent))}
    finally:
        del scheduler.schedule  # type: ignore[method-assign]
    with_image = [ids for ids in ticks if "image" in ids]
    assert with_image and all(ids == ["image"] for ids in with_image), ticks  # alone, every step
    finished = {rid: out.metrics.finished_time for rid, out in outs.items()}
    assert all(finished["image"] < finished[rid] for rid in clips)
    assert all(outs[rid].metrics.preemptions == 1 for rid in clips)
    for rid, out in outs.items():
        assert np.abs(frames(out) - alone[rid]).max() <= 1, rid
    assert any("ranks above" in d.reason for d in engine.scheduler.share.log)
    stats = engine.stats()
    assert (stats.requests_paused, stats.paused_state_bytes) == (0, 0)
    assert_clean(engine)
    assert_no_step_states(engine)
