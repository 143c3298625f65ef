"""Helios through the engine (in-process executor) on tiny-helios: each
finished chunk comes out of ``step_streaming`` as a progress item whose
``preview`` is the chunk's frames, before the clip; the clip is the same in
request-batch execution; two clips of other lengths share steps; what
Helios does not run is refused naming its field."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_helpers import assert_clean, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.config import EngineConfigError
from diffrt.engine.sampling import InvalidRequestError

pytest.importorskip("diffusers")

WINDOW = 5  # tiny-helios' chunk: 2 latent frames


def clip_request(seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt=f"a red fox {seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"model": "tiny-helios", "executor_backend": "inproc",
                           "warmup": False, **kw})


@pytest.fixture(scope="module")
def engines():
    # share_steps="always": clips of any size share a step whatever the cost
    # model predicts, since what a shared step computes is what is tested
    step_config = config(step_execution=True, max_num_seqs=2, share_steps="always")
    with shared_engine(DiffusionEngine.make_engine(config(max_num_seqs=2))) as req, \
            shared_engine(DiffusionEngine.make_engine(step_config)) as step:
        yield req, step


def frames_of(clip) -> np.ndarray:
    return np.stack([np.asarray(f) for f in clip]).astype(np.int16)


def test_each_finished_chunk_streams_before_the_clip(engines):
    req, step = engines

    async def items():
        return [o async for o in step.step_streaming(clip_request(5, num_frames=13))]

    outs = asyncio.run(items())
    chunks = [o for o in outs if o.preview is not None]
    final = outs[-1]
    assert final.ok and final.total_steps == 6  # 3 chunks of 2 steps
    assert [(c.preview_index, c.step) for c in chunks] == [(0, 2), (1, 4)]
    clip = frames_of(final.frames[0])
    assert clip.shape == (13, 32, 32, 3)
    for k, c in enumerate(chunks):
        [frames] = c.preview  # one output: the chunk's frames
        assert np.abs(frames_of(frames) - clip[k * WINDOW:(k + 1) * WINDOW]).max() == 0
    whole = frames_of(req.generate(clip_request(5, num_frames=13)).frames[0])
    assert np.abs(whole - clip).max() <= 1
    assert_clean(step)


def test_clips_of_other_lengths_and_sizes_share_steps(engines):
    _, step = engines
    reqs = [clip_request(2), clip_request(3, num_frames=13, height=48)]
    alone, steps = [], []
    for r in reqs:
        first = step.stats().step_batch_rows.count
        alone.append(frames_of(step.generate(r).frames[0]))
        steps.append(step.stats().step_batch_rows.count - first)
    before = step.stats().step_batch_rows
    together = [frames_of(o.frames[0]) for o in step.generate(reqs)]
    after = step.stats().step_batch_rows
    assert together[1].shape == (13, 48, 32, 3)
    for got, want in zip(together, alone, strict=True):
        assert np.abs(got - want).max() <= 1
    # the short clip's steps ran beside the long one's: as many steps as the longest alone
    assert after.count - before.count == max(steps) < sum(steps)
    assert_clean(step)


@pytest.mark.parametrize("params,named", [
    ({"cache": "first-block"}, "cache"), ({"loras": {"x": 1.0}}, "loras"),
    ({"partial_images": 1}, "partial_images"), ({"num_frames": 11}, "num_frames")])
def test_what_helios_does_not_run_is_refused_naming_its_field(engines, params, named):
    _, step = engines
    with pytest.raises(InvalidRequestError) as info:
        step.generate(clip_request(1, **params))
    assert info.value.field == named and "\n" not in str(info.value)


@pytest.mark.parametrize("field,value,named", [
    ("offload", "layerwise", "offload"), ("quantization", "int8", "quantization"),
    ("cfg_parallel_size", 2, "world_size")])
def test_engine_features_helios_does_not_run_are_refused(field, value, named):
    from diffrt.platforms import current_platform

    with pytest.raises(EngineConfigError) as info:
        config(**{field: value, "executor_backend": "mp"}).executor_config(
            platform=current_platform)
    assert info.value.field == named and "\n" not in str(info.value)


def test_an_input_image_is_refused(engines):
    from PIL import Image

    _, step = engines
    with pytest.raises(InvalidRequestError) as info:
        step.generate(DiffusionRequest(prompt="a fox", images=[Image.new("RGB", (32, 32))]))
    assert info.value.field == "images"


def test_a_folder_with_another_helios_schedule_is_refused_at_load(tmp_path):
    import json

    from diffrt.engine.models.family import ModelFolder
    from diffrt.engine.models.folder_check import ModelLoadError
    from diffrt.engine.pipelines.helios.spec import check_scheduler

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({"stages": 3}))
    with pytest.raises(ModelLoadError, match="3-stage unipc"):
        check_scheduler(ModelFolder(str(tmp_path), "pyramid", {}))
