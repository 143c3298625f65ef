"""Property tests: whatever a client sends, each request is either refused at
submission with the field named, or served; no good request ever fails because
of a neighbour; the engine stays healthy."""

from __future__ import annotations

import asyncio

import engine_toy as toy
import numpy as np
import pytest
from engine_helpers import assert_clean
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffrt.engine import DiffusionRequest, InvalidRequestError, SamplingParams

FIELDS = {"request", "request_id", "prompt", "negative_prompt", "sampling_params", "height",
          "width", "num_inference_steps", "guidance_scale", "num_outputs_per_prompt", "seed",
          "output_type", "loras", "timeout_s"}

anything = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=2))

#: a well-formed value per field, and what an arbitrary client may send instead
VALID = {
    "height": st.sampled_from([8, 16, 24]),
    "width": st.sampled_from([8, 16, 24]),
    "num_inference_steps": st.integers(min_value=1, max_value=3),
    "guidance_scale": st.sampled_from([1.0, 3.5]),
    "seed": st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**64 - 1)),
    "num_outputs_per_prompt": st.integers(min_value=1, max_value=2),
    "output_type": st.sampled_from(["pil", "pt"]),
    "timeout_s": st.sampled_from([None, 60.0]),
}
WILD = {
    **{name: anything for name in VALID},
    "seed": st.one_of(st.integers(min_value=-(2**66), max_value=2**66), anything),
    "prompt": st.one_of(st.sampled_from(["\ud800", "a\udfffb", "x" * 70000]), anything),
    "request_id": st.one_of(st.text(max_size=300), anything),
    "sampling_params": st.one_of(st.none(), st.dictionaries(st.text(max_size=3),
                                                            st.integers(), max_size=2)),
}


@st.composite
def requests(draw) -> object:
    """A request as an arbitrary client would build one: most fields
    well-formed, zero to two of them anything at all."""
    wild = draw(st.lists(st.sampled_from(sorted(WILD)), max_size=2, unique=True))
    values = {name: draw(WILD[name] if name in wild else strategy)
              for name, strategy in VALID.items()}
    prompt = draw(WILD["prompt"]) if "prompt" in wild else draw(st.text(max_size=40))
    rid = draw(WILD["request_id"]) if "request_id" in wild else None
    params = draw(WILD["sampling_params"]) if "sampling_params" in wild \
        else SamplingParams(**values)
    try:
        return DiffusionRequest(prompt=prompt, sampling_params=params, request_id=rid)
    except InvalidRequestError as exc:  # refused while being built: also a refusal
        return exc


def good(seed: int) -> DiffusionRequest:
    return DiffusionRequest(prompt="good", sampling_params=SamplingParams(
        height=16, width=16, num_inference_steps=2, seed=seed))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mix=st.lists(requests(), min_size=1, max_size=5))
@pytest.mark.parametrize("mode", ["request", "step"])
def test_every_request_is_refused_by_name_or_served_and_neighbours_never_suffer(
        req_engine4, step_engine4, mode, mix):
    engine = req_engine4 if mode == "request" else step_engine4

    async def submit(item):
        if isinstance(item, InvalidRequestError):
            return item
        try:
            return await engine.generate_async(item)
        except InvalidRequestError as exc:
            return exc

    async def main():
        goods = [good(100 + i) for i in range(2)]
        results = await asyncio.gather(*(submit(x) for x in [goods[0], *mix, goods[1]]))
        return results[0], results[1:-1], results[-1]

    first, middle, last = asyncio.run(main())
    for out, seed in ((first, 100), (last, 101)):
        assert out.ok, out.error
        values = {int(v) for img in out.images for v in np.unique(np.asarray(img))}
        assert values == {toy.expected_pixel(seed, 2)}
    for result in middle:
        if isinstance(result, InvalidRequestError):
            assert result.field in FIELDS, result
        else:  # served: finished, with its own seed reported
            assert result.finished, result
            # a valid but tiny timeout_s may expire before even a toy request ends
            assert result.ok or "timed out" in (result.error or ""), result.error
            assert isinstance(result.seed, int)
    assert engine.is_healthy()
    assert_clean(engine)
