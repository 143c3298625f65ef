"""The engine on the real embedded models (in-process executor): both modes give
the same image for the same request, alone or batched."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import assert_clean, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams


def flux_request(seed: int, steps: int = 3, rid: str | None = None, **kw) -> DiffusionRequest:
    return DiffusionRequest(prompt=f"a red fox {seed}", request_id=rid,
                            sampling_params=SamplingParams(height=64, width=64,
                                                           num_inference_steps=steps, seed=seed,
                                                           **kw))


@pytest.fixture(scope="module")
def flux_engines():
    common = dict(model="tiny-flux", executor_backend="inproc", max_num_seqs=2)
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(**common))) as req, \
            shared_engine(DiffusionEngine.make_engine(EngineConfig(step_execution=True, **common))) as step:
        yield req, step


def image(out) -> np.ndarray:
    assert out.ok, out.error
    return np.asarray(out.images[0]).astype(np.int16)


def test_request_and_step_modes_agree(flux_engines):
    req, step = flux_engines
    a = image(req.generate(flux_request(7)))
    b = image(step.generate(flux_request(7)))
    assert a.shape == (64, 64, 3)
    assert np.abs(a - b).max() <= 1


def test_batching_does_not_change_a_request_image(flux_engines):
    req, step = flux_engines
    alone = image(req.generate(flux_request(11)))
    fused = req.generate([flux_request(11), flux_request(12)])
    assert np.abs(image(fused[0]) - alone).max() <= 1
    assert np.abs(image(fused[0]) - image(fused[1])).max() > 8  # different seeds differ
    # In step mode with a batch mate that has a different step count...
    mixed = step.generate([flux_request(11), flux_request(13, steps=5)])
    assert np.abs(image(mixed[0]) - alone).max() <= 1
    # ...and with one that finishes in the same tick (decoded together).
    together = step.generate([flux_request(12), flux_request(11)])
    assert np.abs(image(together[1]) - alone).max() <= 1
    assert np.abs(image(together[0]) - image(fused[1])).max() <= 1
    assert_clean(req)
    assert_clean(step)


def test_cfg_and_latent_outputs(flux_engines):
    req, step = flux_engines
    out = step.generate(flux_request(3, guidance_scale=3.0, output_type="latent"))
    assert out.ok and out.images is None and out.output.dtype.is_floating_point
    assert tuple(out.output.shape) == (1, 4, 8, 8)  # VAE latents of a 64x64 image


def test_tiny_sd3_runs_through_the_engine():
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-sd3", executor_backend="inproc",
                                                  warmup=False)) as engine:
        out = engine.generate(DiffusionRequest(
            prompt="a lighthouse",
            sampling_params=SamplingParams(height=64, width=64, num_inference_steps=2, seed=0)))
        assert out.ok and out.images[0].size == (64, 64)


def test_several_outputs_per_prompt_decoded_together(flux_engines):
    req, step = flux_engines
    alone = req.generate(flux_request(21, num_outputs_per_prompt=2))
    both = step.generate([flux_request(21, num_outputs_per_prompt=2),
                          flux_request(22, num_outputs_per_prompt=2)])
    assert [len(o.images) for o in both] == [2, 2]
    for i in range(2):
        a = np.asarray(alone.images[i]).astype(np.int16)
        b = np.asarray(both[0].images[i]).astype(np.int16)
        assert np.abs(a - b).max() <= 1


def test_multi_step_ticks_are_bit_identical_to_one_step_per_tick(flux_engines, monkeypatch):
    """Running several denoise steps per worker call changes only how often
    the engine and the worker talk, never the arithmetic: the same requests
    (batched, different step counts) give the same tensors, to the bit, with
    one step per call."""
    import torch

    _, multi = flux_engines
    sent: list = []
    real = multi.executor.execute
    monkeypatch.setattr(multi.executor, "execute",
                        lambda request, *a, **kw: sent.append(request) or real(request, *a, **kw))

    def batch() -> list[DiffusionRequest]:
        return [flux_request(21, steps=5, output_type="pt"),
                flux_request(22, steps=3, output_type="pt")]

    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", max_num_seqs=2, step_execution=True,
            max_steps_per_tick=1))) as single:
        got = [multi.generate(batch()), single.generate(batch())]
    assert max(getattr(m, "steps", 1) for m in sent) > 1  # several steps per call did happen
    for a, b in zip(*got, strict=True):
        assert a.ok and b.ok
        assert torch.equal(a.output, b.output)


def test_a_compiled_denoiser_matches_eager_within_2_of_255(flux_engines):
    """compile=True: torch.compile of the transformer (the cheap aot_eager
    backend here; the benchmark measures inductor) gives the eager images
    within 2/255, in both modes."""
    req, step = flux_engines
    for eager, mode in ((req, False), (step, True)):
        with shared_engine(DiffusionEngine.make_engine(EngineConfig(
                model="tiny-flux", executor_backend="inproc", step_execution=mode,
                compile=True, compile_backend="aot_eager"))) as compiled:
            runner = compiled.executor.core.runner
            assert type(runner.pipeline.transformer).__name__ == "OptimizedModule"
            a = image(eager.generate(flux_request(31, steps=3)))
            b = image(compiled.generate(flux_request(31, steps=3)))
        assert np.abs(a - b).max() <= 2
