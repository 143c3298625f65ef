"""Helpers of the engine tests (a module of its own: `conftest` is ambiguous
when the whole suite runs)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import engine_toy  # registers the toy models
from waiting import wait_until  # re-exported: the engine tests import it from here

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.config import ExecutionMode
from diffrt.engine.runner_messages import CountStepStates, StepStateCount

_ids = itertools.count()

#: Engines that module-scoped fixtures share between tests (``shared_engine``).
SHARED_ENGINES: list[DiffusionEngine] = []


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
    kw.setdefault("max_pending_output_bytes", 16 << 20)
    return DiffusionEngine.make_engine(EngineConfig(**kw))


def assert_clean(engine: DiffusionEngine) -> None:
    """Nothing left: no active request, no stream, no output held by the runtime."""
    assert wait_until(lambda: engine.num_active_requests() == 0)
    assert engine.output_processor.num_streams() == 0
    router = getattr(engine.executor, "router", None)
    if router is not None:
        assert wait_until(lambda: router.counts()["arrived"] == 0 and router.counts()["waiting"] == 0), router.counts()


def assert_no_step_states(engine: DiffusionEngine) -> None:
    """The worker holds no step state (every request's was dropped at its end)."""
    assert wait_until(lambda: engine.executor.collective_rpc(CountStepStates()) == [StepStateCount(0)])


@contextlib.contextmanager
def shared_engine(engine: DiffusionEngine) -> Iterator[DiffusionEngine]:
    """Share ``engine`` between the tests of a module (closed at the end): while it
    lives, ``settle_shared_engines`` checks it around every test."""
    SHARED_ENGINES.append(engine)
    try:
        with engine:
            yield engine
    finally:
        SHARED_ENGINES.remove(engine)


def engine_threads() -> set[threading.Thread]:
    """The live threads of engines and their in-process executors (named
    "diffrt-..."), less the post-processing pool's, which a shared engine starts
    lazily."""
    return {t for t in threading.enumerate()
            if t.name.startswith("diffrt-") and not t.name.startswith("diffrt-postprocess")}


def settle_shared_engines() -> None:
    """The state every engine test starts and ends in, whatever ran before: all
    toy gates open (a request left blocked runs out), every shared engine healthy
    and idle, the toy call log empty. Tests that close or break an engine use
    their own, never a shared one."""
    engine_toy.open_gates()
    for engine in SHARED_ENGINES:
        assert engine.is_healthy(), "a test closed or broke an engine its module shares"
        assert_clean(engine)
        if engine.mode is ExecutionMode.STEP_BATCH:
            assert_no_step_states(engine)
    engine_toy.reset()


def assert_shared_steps(before, after, rows: int, steps: int) -> None:
    """Between two ``step_batch_rows`` histograms: a step ran ``rows`` rows at
    once, and ``steps`` steps ran in all (the longest request's: one at a time)."""
    bucket = next(i for i, bound in enumerate(after.bounds) if rows <= bound)
    assert after.counts[bucket] > before.counts[bucket]
    assert after.count - before.count == steps
