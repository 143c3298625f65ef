"""Video through the engine (in-process executor) on tiny-wan: the default
output is each output's frames (PIL) with the clip's frame rate, "np" and
"pt" are (N, F, H, W, 3) uint8, "latent" the VAE's (N, C, F, h, w); both
execution modes give the same frames; requests of different frame counts
and sizes share steps and each equals its run alone (the video families'
refusals are tested with each family: test_ltx2_family, test_helios_engine)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import assert_clean, shared_engine

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

pytest.importorskip("diffusers")


def clip_request(seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt=f"a red fox {seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"model": "tiny-wan", "executor_backend": "inproc", "warmup": False,
                           **kw})


@pytest.fixture(scope="module")
def engines():
    # share_steps="always": clips of any size share a step whatever the cost
    # model predicts, since what a shared step computes is what is tested
    step_config = config(step_execution=True, max_num_seqs=4, share_steps="always")
    with shared_engine(DiffusionEngine.make_engine(config(max_num_seqs=2))) as req, \
            shared_engine(DiffusionEngine.make_engine(step_config)) as step:
        yield req, step


def clip(out) -> np.ndarray:
    assert out.ok, out.error
    assert out.images is None and len(out.frames) == 1
    return np.stack([np.asarray(f) for f in out.frames[0]]).astype(np.int16)


def test_frames_come_back_in_every_output_type_alike_in_both_modes(engines):
    req, step = engines
    out = req.generate(clip_request(1))
    frames = clip(out)
    assert frames.shape == (9, 64, 64, 3) and out.fps == 16.0
    assert np.abs(clip(step.generate(clip_request(1))) - frames).max() <= 1
    array = step.generate(clip_request(1, output_type="np"))
    assert isinstance(array.output, np.ndarray) and array.output.dtype == np.uint8
    assert np.abs(array.output[0].astype(np.int16) - frames).max() <= 1
    tensor = req.generate(clip_request(1, output_type="pt", fps=24.0))
    assert tuple(tensor.output.shape) == (1, 9, 64, 64, 3) and tensor.fps == 24.0
    latent = req.generate(clip_request(1, output_type="latent"))
    assert tuple(latent.output.shape) == (1, 16, 3, 8, 8)
    assert_clean(req)


def test_clips_of_different_frame_counts_and_sizes_share_steps(engines):
    _, step = engines
    reqs = [clip_request(2), clip_request(3, num_frames=5, height=32, width=48)]
    alone = [clip(step.generate(r)) for r in reqs]
    before = step.stats().step_batch_rows
    together = [clip(o) for o in step.generate(reqs)]
    after = step.stats().step_batch_rows
    assert together[1].shape == (5, 32, 48, 3)
    for got, want in zip(together, alone, strict=True):
        assert np.abs(got - want).max() <= 1
    assert after.count - before.count == 4  # their 4 steps ran together
    assert_clean(step)


def test_a_preview_is_the_frames_of_the_current_prediction(engines):
    import asyncio

    _, step = engines

    async def items():
        return [o async for o in step.step_streaming(clip_request(5, partial_images=1))]

    outs = asyncio.run(items())
    previews = [o for o in outs if o.preview is not None]
    assert len(previews) == 1 and previews[0].step == 2
    [frames] = previews[0].preview  # one output: its 9 frames
    assert len(frames) == 9 and frames[0].size == (64, 64)
    assert outs[-1].finished and len(outs[-1].frames[0]) == 9


def test_np_output_is_a_uint8_array_for_images_and_clips():
    import torch

    from diffrt.engine.postprocess import postprocess_output, quantize_images

    image = quantize_images(torch.zeros(2, 3, 8, 16))  # mid-grey, (N, C, H, W) in [-1, 1]
    clip = quantize_images(torch.ones(1, 3, 5, 8, 16))  # white, (N, C, F, H, W)
    for tensor, shape, level in ((image, (2, 8, 16, 3), 128), (clip, (1, 5, 8, 16, 3), 255)):
        images, array = postprocess_output(tensor, "np")
        assert images is None and isinstance(array, np.ndarray)
        assert array.shape == shape and array.dtype == np.uint8 and (array == level).all()
    [frames], _ = postprocess_output(clip, "pil")
    assert len(frames) == 5 and frames[0].size == (16, 8)


def _decode(data: bytes):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
    from video_decode import decode_mp4, psnr

    return decode_mp4(data), psnr


def test_mp4_output_is_each_clips_encoded_bytes_beside_its_frames(engines):
    req, step = engines
    out = step.generate(clip_request(4, output_type="mp4", fps=24.0))
    assert out.ok, out.error
    [data] = out.output
    decoded, psnr = _decode(data)
    frames = clip(out).astype(np.uint8)  # the frames come too
    assert decoded.frames.shape == frames.shape and decoded.fps == 24
    assert decoded.codec == "h264" and decoded.pix_fmt == "yuv420p"
    assert min(psnr(d, f) for d, f in zip(decoded.frames, frames, strict=True)) >= 20
    with pytest.raises(Exception, match="output_type"):  # an image model has no mp4
        from diffrt.engine.model_spec import ModelSpec  # noqa: F401

        config(model="tiny-sd3").model_spec().check(
            DiffusionRequest(prompt="x", sampling_params=SamplingParams(output_type="mp4")))
    assert_clean(step)


def test_generate_writes_an_mp4_for_a_mp4_path(tmp_path, capsys):
    from diffrt.cli import main

    path = tmp_path / "clip.mp4"
    code = main(["generate", "--model", "tiny-wan", "--prompt", "a red fox", "--num-frames", "5",
                 "--steps", "2", "--seed", "3", "--executor-backend", "inproc", "--no-progress",
                 "-o", str(path)])
    assert code == 0
    decoded, _ = _decode(path.read_bytes())
    assert decoded.frames.shape == (5, 64, 64, 3) and decoded.fps == 16
    assert "(H.264, 5 frames of 64x64, a 0.31 s clip at 16 fps" in capsys.readouterr().out
