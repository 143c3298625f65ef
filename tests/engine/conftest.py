"""Engine test fixtures: engines on the in-process executor around the toy
pipeline (instant, model-free), shared per module; helpers to build requests."""

from __future__ import annotations

import itertools
import time

import engine_toy  # noqa: F401  (registers the toy models)
import pytest

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

_ids = itertools.count()


def toy_request(prompt: str = "p", *, seed: int = 0, steps: int = 2, size: int = 16,
                rid: str | None = None, **kw) -> DiffusionRequest:
    return DiffusionRequest(
        prompt=prompt, request_id=rid or f"t{next(_ids)}",
        sampling_params=SamplingParams(height=size, width=size, num_inference_steps=steps,
                                       seed=seed, **kw),
    )


def toy_engine(**kw) -> DiffusionEngine:
    kw.setdefault("model", "toy")
    kw.setdefault("executor_backend", "inproc")
    kw.setdefault("executor_options", {"max_pending_output_bytes": 16 << 20})
    return DiffusionEngine.make_engine(EngineConfig(**kw))


def wait_until(cond, timeout: float = 10.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def assert_clean(engine: DiffusionEngine) -> None:
    """Nothing left: no active request, no stream, no output held by the runtime."""
    assert wait_until(lambda: engine.num_active_requests() == 0)
    assert not engine._streams
    router = getattr(engine.executor, "router", None)
    if router is not None:
        assert wait_until(lambda: router.counts()["arrived"] == 0 and router.counts()["waiters"] == 0), router.counts()


@pytest.fixture(scope="module")
def req_engine1():
    with toy_engine(max_num_seqs=1) as e:
        yield e


@pytest.fixture(scope="module")
def req_engine4():
    with toy_engine(max_num_seqs=4) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine1():
    with toy_engine(max_num_seqs=1, step_execution=True) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine4():
    with toy_engine(max_num_seqs=4, step_execution=True) as e:
        yield e
