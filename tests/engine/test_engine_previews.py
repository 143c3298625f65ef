"""Previews (``partial_images``): step-mode requests stream their predicted
image at steps ceil(k * T / (N + 1)), ahead of the final image, which previews
do not change; a request that leaves early leaves nothing behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_helpers import assert_clean

from diffrt.engine import (
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    InvalidRequestError,
    SamplingParams,
)


@pytest.mark.parametrize(("steps", "n", "expected"), [
    (8, 3, [2, 4, 6]), (28, 2, [10, 19]), (2, 3, [1]), (1, 3, []), (8, 0, []), (4, 1, [2])])
def test_preview_steps(steps, n, expected):
    assert SamplingParams(num_inference_steps=steps, partial_images=n).preview_steps() == expected


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_partial_images_range(bad):
    with pytest.raises(InvalidRequestError, match="partial_images"):
        SamplingParams(height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                       true_cfg_scale=1.0,
                       partial_images=bad).validate()


@pytest.fixture
def engine(flux_step_engine):
    return flux_step_engine


def _request(seed: int, partial_images: int, steps: int = 8) -> DiffusionRequest:
    return DiffusionRequest("a red fox in the snow", SamplingParams(
        height=64, width=64, num_inference_steps=steps, seed=seed,
        partial_images=partial_images))


async def _collect(engine, request):
    return [o async for o in engine.step_streaming(request)]


def test_previews_come_in_order_before_the_final_image(engine):
    async def main():
        return await asyncio.gather(_collect(engine, _request(1, 3)),
                                    _collect(engine, _request(1, 0)),
                                    _collect(engine, _request(2, 2)))

    with_previews, without, other = asyncio.run(main())
    previews = [o for o in with_previews if o.preview is not None]
    assert [(o.preview_index, o.step) for o in previews] == [(0, 2), (1, 4), (2, 6)]
    assert with_previews[-1].finished and with_previews[-1].ok
    assert all(not o.finished for o in with_previews[:-1])
    assert [o.preview_index for o in other if o.preview is not None] == [0, 1]
    assert not any(o.preview is not None for o in without)

    final = np.asarray(with_previews[-1].images[0]).astype(np.int16)
    # asking for previews does not change the image (the two may join the step
    # batch at different steps, so batched matmuls may round differently: the
    # contract is 1/255, bit-identical only when batched alike)
    assert np.abs(final - np.asarray(without[-1].images[0]).astype(np.int16)).max() <= 1
    # each preview is the image as predicted then: closer to the final as steps go
    errors = [np.abs(np.asarray(o.preview[0]).astype(np.int16) - final).mean()
              for o in previews]
    assert previews[0].preview[0].size == (64, 64)
    assert errors[0] > errors[1] > errors[2] > 0, errors


def test_leaving_after_the_first_preview_leaves_nothing(engine):
    async def main():
        request = _request(3, 3, steps=12)
        async for out in engine.step_streaming(request):
            if out.preview is not None:
                engine.abort(request.request_id)
                break

    asyncio.run(main())
    assert_clean(engine)


def test_request_mode_refuses_previews():
    with DiffusionEngine.make_engine(EngineConfig(model="toy", executor_backend="inproc",
                                                  warmup=False)) as engine:
        with pytest.raises(InvalidRequestError, match="partial_images: previews need step"):
            engine.generate(DiffusionRequest("x", SamplingParams(partial_images=1)))


def test_a_preview_landing_after_its_request_ended_is_freed(monkeypatch):
    """The request is aborted while its preview is still on its way to the
    host: the late preview is dropped and its output slot freed."""
    from faults import hold_outputs
    from test_isolation import _writer

    gate = hold_outputs(monkeypatch)
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", step_execution=True,
            async_output=True, warmup=False)) as engine:
        request = _request(5, 1, steps=12)  # its preview after step 6

        async def main():
            async for out in engine.step_streaming(request):
                assert out.preview is None  # held: it cannot have landed
                if out.step >= 8:
                    engine.abort(request.request_id)
                    break

        asyncio.run(main())
        gate.set()
        assert_clean(engine)
        from waiting import wait_until

        assert wait_until(lambda: _writer(engine).used_bytes == 0)
