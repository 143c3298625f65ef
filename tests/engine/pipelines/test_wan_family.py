"""The Wan family against diffusers' own Wan pipelines on the embedded tiny
folders (float32, same seed and scheduler settings): text-to-video alone,
request-batched and step-batched; step-batched beside a request of another
frame count and size; Wan 2.2's expert switch at the folder's boundary; and
image-to-video from a first frame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_steps import stepped

from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES, SIZE, STEPS = 9, 64, 4  # the tiny folders' defaults
MAX_DIFF = 2  # of 255 per frame, float32


@pytest.fixture(scope="module")
def t2v():
    folder = embedded_folder("tiny-wan")
    theirs = diffusers.WanPipeline.from_pretrained(folder, local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    return theirs, load_pipeline("tiny-wan")


def reference(pipe, prompt: str, seed: int, frames: int = FRAMES, height: int = SIZE,
              width: int = SIZE, **kw) -> np.ndarray:
    video = pipe(prompt=prompt, num_frames=frames, height=height, width=width,
                 num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                 output_type="np", **kw).frames[0]
    return (video * 255).round().astype(np.int16)


def request(prompt: str, seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt=prompt, request_id=f"{prompt}-{seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


def frames(video: torch.Tensor) -> np.ndarray:
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) levels, as the engine quantises them."""
    return quantize_images(video)[0].numpy().astype(np.int16)


def test_text_to_video_alone_batched_and_stepped_matches_diffusers(t2v):
    theirs, ours = t2v
    requests = [request("a red fox in the snow", 0), request("a blue square on grass", 1)]
    expected = [reference(theirs, r.prompt, r.sampling_params.seed) for r in requests]
    alone = [ours.forward(DiffusionRequestBatch([r]))[0] for r in requests]
    batched = ours.forward(DiffusionRequestBatch(requests))
    steps = stepped(ours, requests)
    for want, *got in zip(expected, alone, batched, steps, strict=True):
        assert want.shape == (FRAMES, SIZE, SIZE, 3)
        for video in got:
            assert np.abs(frames(video) - want).max() <= MAX_DIFF
    assert np.abs(expected[0] - expected[1]).mean() > 2  # the prompt shows


def block_calls(pipe, rows: list[int]) -> list:
    """Hooks that note the rows of each call of either expert's first block."""
    return [getattr(pipe, name).blocks[0].register_forward_pre_hook(
        lambda _m, args: rows.append(args[0].shape[0])) for name in ("transformer", "transformer_2")]


def test_step_batched_with_another_frame_count_and_size_each_equal_alone(t2v):
    """A 9-frame 64^2 clip and a 5-frame 32 x 48 one: padded, one call of
    their 4 rows a step (a rotary table per row); by_size, a call per size."""
    _, ours = t2v
    a = request("a red fox", 3)
    b = request("a red fox", 4, num_frames=5, height=32, width=48)
    solo = [stepped(ours, [r])[0] for r in (a, b)]
    kept = ours.mixed_rows
    for arrangement, calls in (("padded", [4] * STEPS), ("by_size", [2] * (2 * STEPS))):
        rows: list[int] = []
        hooks = block_calls(ours, rows)
        ours.use_mixed_rows(arrangement)
        try:
            together = stepped(ours, [a, b])
        finally:
            ours.use_mixed_rows(kept)
            for h in hooks:
                h.remove()
        assert rows == calls, arrangement
        assert together[1].shape == (1, 3, 5, 32, 48)
        for alone, shared in zip(solo, together, strict=True):
            assert np.abs(frames(alone) - frames(shared)).max() <= 1, arrangement


def test_a_cached_clip_padded_beside_another_size_decides_as_alone(t2v):
    """First-block cache in a padded call: the request's rows narrowed out
    of the call (their rotary table and key mask with them) decide and
    compute as they do alone."""
    _, ours = t2v
    cached = request("a red fox", 7, num_inference_steps=6, cache="first-block",
                     cache_threshold=0.9)
    other = request("a blue square", 8, num_frames=5, height=32, width=48, num_inference_steps=6)
    def run(requests):
        videos = stepped(ours, requests)
        return videos, ours.take_cache_metrics()[cached.request_id].reused_steps

    alone, reused = run([cached])
    assert ours.mixed_rows == "padded"  # the bare pipeline's arrangement
    together, shared = run([cached, other])
    assert shared == reused and reused  # it reused, at the steps it does alone
    assert np.abs(frames(together[0]) - frames(alone[0])).max() <= 1


def test_the_experts_switch_at_the_step_diffusers_switches(t2v):
    theirs, ours = t2v
    seen: dict[str, list[str]] = {"theirs": [], "ours": []}

    def spy(pipe, who: str) -> list:
        handles = []
        for name in ("transformer", "transformer_2"):
            handles.append(getattr(pipe, name).register_forward_pre_hook(
                lambda *_a, name=name: seen[who].append(name)))
        return handles

    handles = spy(theirs, "theirs") + spy(ours, "ours")
    try:
        reference(theirs, "a red fox", 0)
        ours.forward(DiffusionRequestBatch([request("a red fox", 0)]))
    finally:
        for h in handles:
            h.remove()
    # diffusers calls each expert twice a step (cond, uncond); diffrt once with both rows
    assert seen["theirs"][::2] == seen["ours"]
    assert ours.boundary == theirs.config.boundary_ratio * 1000
    _, timesteps = ours.prepare_timesteps(ours.prepared(request("a red fox", 0)).sampling_params)
    assert seen["ours"] == ["transformer" if t >= ours.boundary else "transformer_2"
                            for t in timesteps.tolist()]
    assert set(seen["ours"]) == {"transformer", "transformer_2"}


def test_image_to_video_from_a_first_frame_matches_diffusers():
    import PIL.Image

    folder = embedded_folder("tiny-wan-i2v")
    theirs = diffusers.WanImageToVideoPipeline.from_pretrained(folder, local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    ours = load_pipeline("tiny-wan-i2v")
    pixels = (np.random.default_rng(0).random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    first = PIL.Image.fromarray(pixels)
    want = reference(theirs, "a red fox", 2, image=first)
    r = DiffusionRequest(prompt="a red fox", request_id="i2v", images=[first],
                         sampling_params=SamplingParams(seed=2))
    got = ours.forward(DiffusionRequestBatch([r]))[0]
    assert np.abs(frames(got) - want).max() <= MAX_DIFF
    other = DiffusionRequest(prompt="a red fox", request_id="i2v-other",
                             images=[PIL.Image.fromarray(255 - pixels)],
                             sampling_params=SamplingParams(seed=2))
    changed = ours.forward(DiffusionRequestBatch([other]))[0]
    assert np.abs(frames(changed) - frames(got)).mean() > 1  # the first frame shows
    # two image-to-video requests batched: each its own clip
    for alone, shared in zip((got, changed), ours.forward(DiffusionRequestBatch([r, other])),
                             strict=True):
        assert np.abs(frames(alone) - frames(shared)).max() <= 1
    # stepped beside a clip of another frame count and size, one padded call a
    # step: each row's condition channels at its own size, each as alone
    small = DiffusionRequest(prompt="a red fox", request_id="i2v-small", images=[first],
                             sampling_params=SamplingParams(seed=3, num_frames=5, height=32,
                                                            width=48))
    assert ours.mixed_rows == "padded"
    for alone, shared in zip((got, stepped(ours, [small])[0]), stepped(ours, [r, small]),
                             strict=True):
        assert np.abs(frames(alone) - frames(shared)).max() <= 1


def test_frames_are_checked_at_submission_and_counted_by_the_budget():
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.sampling import InvalidRequestError

    spec = resolve_model_spec("tiny-wan")
    filled = spec.with_defaults(request("a fox", 0)).sampling_params
    assert (filled.num_frames, filled.fps) == (FRAMES, 16.0)  # the folder's, Wan's rate
    for bad in (8, 10, spec.max_frames + 4):
        with pytest.raises(InvalidRequestError, match="num_frames.*4k \\+ 1") as info:
            spec.check(request("a fox", 0, num_frames=bad))
        assert info.value.field == "num_frames"
    spec.check(request("a fox", 0, num_frames=13, fps=24.0))
    # 13 frames: 4 latent frames of 4 x 4 patches, beside 512 text tokens
    assert spec.row_tokens(spec.with_defaults(request("a", 0, num_frames=13))) == 4 * 16 + 512
    image_model = resolve_model_spec("tiny-sd3")
    for field, value in (("num_frames", 9), ("fps", 16.0)):
        with pytest.raises(InvalidRequestError, match="draws images") as info:
            image_model.check(request("a fox", 0, **{field: value}))
        assert info.value.field == field


def edited_tiny_wan(folder: Path, config: str, **changes: object) -> Path:
    """A copy of tiny-wan at ``folder`` with ``changes`` in one of its JSON configs."""
    import json
    import shutil

    shutil.copytree(embedded_folder("tiny-wan"), folder)
    path = folder / config
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **changes}),
                    encoding="utf-8")
    return folder


def test_a_tokenizer_with_a_shorter_window_sets_the_prompts_padding(tmp_path):
    """A folder whose tokenizer says 16 tokens (a model trained on 16, as
    diffrt-motion) is padded to 16, not Wan's 512: in the spec's token count
    and in the pipeline's encoding (the motion model's own test checks its
    frames against diffusers told ``max_sequence_length=16``)."""
    from transformers import AutoTokenizer

    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.pipelines.wan.pipeline import text_window

    folder = edited_tiny_wan(tmp_path / "wan16", "tokenizer/tokenizer_config.json",
                             model_max_length=16)
    spec = resolve_model_spec(str(folder))
    clip = request("a", 0, num_frames=13, height=SIZE, width=SIZE)
    assert spec.row_tokens(spec.with_defaults(clip)) == 4 * 16 + 16
    assert text_window(AutoTokenizer.from_pretrained(folder / "tokenizer")) == 16
    tiny = resolve_model_spec("tiny-wan")  # 512: what diffusers pads to by default
    assert tiny.row_tokens(tiny.with_defaults(clip)) == 4 * 16 + 512


def test_a_short_rotary_table_caps_the_default_frames(tmp_path):
    """A folder whose rotary table covers fewer latent frames than
    WanPipeline's 81 frames need (the ninth diffrt-motion run's: 32
    positions at 2x in time, 63 frames) defaults to the most it allows, so
    an engine's warm-up, which asks the defaults, starts."""
    from diffrt.engine.models.registry import resolve_model_spec

    folder = edited_tiny_wan(tmp_path / "short-rope", "transformer/config.json",
                             rope_max_seq_len=8)
    spec = resolve_model_spec(str(folder))
    assert spec.max_frames == 7 * spec.frame_factor + 1 < 81
    assert spec.defaults.num_frames == spec.max_frames
    spec.check_frames(spec.with_defaults(request("a", 0)).sampling_params)  # accepted


def test_requests_at_different_steps_share_a_call_across_the_two_experts(t2v):
    """B joins after A's first step: their rows are one call with A's on the
    low-noise expert and B's on the high-noise one, each its own clip."""
    from diffrt.engine.pipelines.interface import StepRequestState

    _, ours = t2v
    a, b = request("a red fox", 5), request("a blue square", 6)
    solo = [stepped(ours, [r])[0] for r in (a, b)]
    calls: list[int] = []
    hooks = [getattr(ours, name).register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["hidden_states"].shape[0]), with_kwargs=True)
        for name in ("transformer", "transformer_2")]
    try:
        first, second = StepRequestState(request=a), StepRequestState(request=b)
        ours.prepare_encode(first)
        ours.apply_step(first, ours.split_predictions(ours.denoise_step([first]), [first])[0])
        ours.prepare_encode(second)
        running = [first, second]
        while running:
            preds = ours.split_predictions(ours.denoise_step(running), running)
            for state, pred in zip(running, preds, strict=True):
                ours.apply_step(state, pred)
            running = [s for s in running if not s.finished]
    finally:
        for h in hooks:
            h.remove()
    # the shared step split its 4 rows (2 requests x CFG) between the experts
    assert 2 in calls[1:3] and calls.count(4) >= 1
    for state, want in zip((first, second), solo, strict=True):
        assert np.abs(frames(ours.post_decode(state)) - frames(want)).max() <= 1
