"""Requests of different sizes share a denoise step (``mixed_size_batching``,
Flux; padded into one transformer call, one call per size, or packed into one
sequence, ``mixed_rows``): each request of a mixed batch equals its own run alone within 1/255
(float32), with and without CFG, with different step counts and output
counts, joining and leaving mid-way; the stats show the steps were shared;
a token budget smaller than the batch admits the rest later; with
``mixed_size_batching=False`` sizes run apart."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from engine_helpers import assert_clean, assert_shared_steps, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

#: (height, width, outputs, steps): the issue's four sizes
SHAPES = [(64, 64, 1, 3), (128, 128, 1, 4), (64, 128, 2, 2), (96, 64, 1, 3)]


def request(i: int, height: int, width: int, n: int, steps: int, *, cfg: bool,
            output_type: str = "pil") -> DiffusionRequest:
    guidance = {"true_cfg_scale": 3.0} if cfg else {}
    return DiffusionRequest(
        prompt=f"a red fox {i}", negative_prompt="blurry" if cfg else None,
        sampling_params=SamplingParams(height=height, width=width, num_outputs_per_prompt=n,
                                       num_inference_steps=steps, seed=i,
                                       output_type=output_type, **guidance))


def batch(cfg: bool) -> list[DiffusionRequest]:
    return [request(i, *shape, cfg=cfg) for i, shape in enumerate(SHAPES)]


def images(out) -> list[np.ndarray]:
    assert out.ok, out.error
    if out.images is None:  # latents
        return [out.output.numpy()]
    return [np.asarray(image).astype(np.int16) for image in out.images]


def assert_same(got, want, tolerance: float = 1) -> None:
    for a, b in zip(images(got), images(want), strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= tolerance


def engine_config(**kw) -> EngineConfig:
    """Sizes share whenever the key allows (``share_steps="always"``): these
    tests check what a shared step computes; whether to share is the cost
    model's (``test_share_steps.py``)."""
    kw.setdefault("share_steps", "always")
    return EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                        max_num_seqs=8, warmup=False, **kw)


@pytest.fixture(scope="module", params=["padded", "by_size", "packed"])
def mixed(request):
    """Every way rows of several sizes share a step: one padded transformer
    call, one call per size, or one call over all rows' tokens packed in one
    sequence (``mixed_rows``; ``auto`` is by_size on CPU)."""
    with shared_engine(DiffusionEngine.make_engine(engine_config(
            mixed_rows=request.param))) as engine:
        yield engine


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
def test_each_request_of_a_mixed_batch_equals_its_run_alone(mixed, cfg):
    alone = [mixed.generate(r) for r in batch(cfg)]
    before = mixed.stats().step_batch_rows
    together = mixed.generate(batch(cfg))
    after = mixed.stats().step_batch_rows
    for got, want in zip(together, alone, strict=True):
        assert_same(got, want)
    assert [o.images[0].size for o in together] == [(w, h) for h, w, _, _ in SHAPES]
    # they shared steps: the first steps ran all 5 rows (10 with CFG) at once
    assert_shared_steps(before, after, 5 * (2 if cfg else 1), max(s for *_, s in SHAPES))
    assert_clean(mixed)


def test_latent_and_image_outputs_share_steps_and_decode_apart(mixed):
    reqs = [request(7, 64, 64, 1, 2, cfg=False, output_type="latent"),
            request(8, 64, 64, 1, 2, cfg=False), request(9, 128, 64, 2, 2, cfg=False)]
    alone = [mixed.generate(r) for r in reqs]
    before = mixed.stats().step_batch_rows.count
    together = mixed.generate(reqs)
    assert mixed.stats().step_batch_rows.count - before == 2  # two shared steps
    assert together[0].images is None and together[0].output.shape == (1, 4, 8, 8)
    for got, want in zip(together, alone, strict=True):
        assert_same(got, want, tolerance=1e-5 if got.images is None else 1)


def test_requests_join_and_leave_mid_way(mixed):
    """A 6-step 64x64 request runs; a 128x96 request joins after its first
    step and a 2-step 64x128 one after that leaves before either."""
    long, joiner, short = (request(20, 64, 64, 1, 6, cfg=False),
                           request(21, 128, 96, 1, 3, cfg=False),
                           request(22, 64, 128, 1, 2, cfg=False))
    alone = {r.prompt: mixed.generate(r) for r in (long, joiner, short)}

    async def run():
        async def finals(req):
            return [o async for o in mixed.step_streaming(req)][-1]

        first = asyncio.ensure_future(finals(long))
        for _ in range(2000):  # until it runs (bounded: 10 s)
            if mixed.stats().requests_running:
                break
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(finals(joiner))
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(finals(short))
        return await asyncio.gather(first, second, third)

    before = mixed.stats().step_batch_rows
    for got, req in zip(asyncio.run(run()), (long, joiner, short), strict=True):
        assert_same(got, alone[req.prompt])
    after = mixed.stats().step_batch_rows
    assert sum(after.counts[1:]) > sum(before.counts[1:])  # some step ran two sizes


def test_a_token_budget_smaller_than_the_batch_admits_the_rest_later():
    """Rows of 512 text + 64 image tokens (128x128): a budget of three such
    rows runs the five-row batch in parts, each request still its own image."""
    per_row = 512 + 64
    with shared_engine(DiffusionEngine.make_engine(engine_config(
            max_num_batched_tokens=3 * per_row))) as engine:
        reqs = batch(cfg=False)
        alone = [engine.generate(r) for r in reqs]
        before = engine.stats().step_batch_tokens
        together = engine.generate(reqs)
        after = engine.stats().step_batch_tokens
        for got, want in zip(together, alone, strict=True):
            assert_same(got, want)
        steps = after.count - before.count
        assert steps > max(s for *_, s in SHAPES)  # not all of them at once
        assert (after.sum - before.sum) / steps <= 3 * per_row


def test_without_mixed_size_batching_sizes_run_apart():
    with shared_engine(DiffusionEngine.make_engine(engine_config(
            mixed_size_batching=False))) as engine:
        before = engine.stats().step_batch_rows
        outs = engine.generate(batch(cfg=False))
        after = engine.stats().step_batch_rows
        assert all(o.ok for o in outs)
        # never more rows in a step than one size's (the 64x128 request: 2)
        assert sum(after.counts[2:]) == sum(before.counts[2:])


# -- a vendor's variable-length attention --------------------------------------------------
def reference_varlen(calls: list[int]):
    """A variable-length attention as ``Platform.varlen_attention`` returns
    one: each packed sequence attends to itself (torch's SDPA, one at a time)."""
    import torch
    import torch.nn.functional as F

    def attend(q, k, v, starts, longest):
        calls.append(len(starts) - 1)
        bounds = starts.tolist()
        assert max(b - a for a, b in itertools.pairwise(bounds)) == longest
        return torch.cat([F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)
            for a, b in itertools.pairwise(bounds)])

    return attend


def test_masked_attention_through_varlen_equals_the_masked_sdpa(monkeypatch):
    import torch

    from diffrt.engine.pipelines.segments import masked_attention
    from diffrt.platforms import current_platform

    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 10, 8) for _ in range(3))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, 7:] = False
    mask[1, 2:4] = False  # not a prefix: text padding before the image tokens
    want = masked_attention(q, k, v, mask)
    calls: list[int] = []
    monkeypatch.setattr(current_platform, "varlen_attention",
                        lambda dtype: reference_varlen(calls))
    got = masked_attention(q, k, v, mask)
    assert calls == [3]
    real = mask[:, None, :, None].expand_as(got)
    assert torch.allclose(got[real], want[real], atol=1e-5)
    assert not got[~real].any()  # a padded query's output: 0, never read


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_a_mixed_step_attends_through_the_platforms_varlen(monkeypatch, rows):
    from diffrt.platforms import current_platform

    calls: list[int] = []
    with shared_engine(DiffusionEngine.make_engine(engine_config(mixed_rows=rows))) as engine:
        alone = [engine.generate(r) for r in batch(cfg=False)]
        assert calls == []  # one size a call: diffusers' own forward
        monkeypatch.setattr(current_platform, "varlen_attention",
                            lambda dtype: reference_varlen(calls))
        together = engine.generate(batch(cfg=False))
    for got, want in zip(together, alone, strict=True):
        assert_same(got, want)
    assert calls and max(calls) == 5  # the five rows of the first steps
