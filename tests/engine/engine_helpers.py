"""Helpers of the engine tests (a module of its own: `conftest` is ambiguous
when the whole suite runs)."""

from __future__ import annotations

import itertools

import engine_toy  # noqa: F401  (registers the toy models)
from waiting import wait_until  # re-exported: the engine tests import it from here

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
    kw.setdefault("max_pending_output_bytes", 16 << 20)
    return DiffusionEngine.make_engine(EngineConfig(**kw))


def assert_clean(engine: DiffusionEngine) -> None:
    """Nothing left: no active request, no stream, no output held by the runtime."""
    assert wait_until(lambda: engine.num_active_requests() == 0)
    assert engine.output_processor.num_streams() == 0
    router = getattr(engine.executor, "router", None)
    if router is not None:
        assert wait_until(lambda: router.counts()["arrived"] == 0 and router.counts()["waiting"] == 0), router.counts()
