"""The LTX-2 family against diffusers' own LTX-2 pipelines on the embedded
tiny folders (float32, same seed and scheduler settings, diffusers' other
guidance terms off as diffrt runs none of them): text-to-video with its
waveform alone, request-batched and step-batched; step-batched beside a
request of another frame count and size; image-to-video from a first frame;
and what is refused at submission, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipeline_steps import stepped

from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.pipelines.sound import split_sound
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

diffusers = pytest.importorskip("diffusers")

FRAMES, SIZE, STEPS, FPS = 9, 32, 4, 24.0  # the tiny folders' defaults, LTX-2's rate
MAX_DIFF = 2  # of 255 per frame, float32
MAX_WAVE_DIFF = 1e-3  # max abs, float32
#: diffusers' LTX-2 guidance as diffrt runs it: CFG on both streams at the
#: request's scale; no STG, modality-isolation guidance or rescale; the tiny
#: folder's 128-token prompts
DIFFUSERS_SETTINGS = dict(audio_guidance_scale=None, stg_scale=0.0, audio_stg_scale=None,
                          modality_scale=1.0, audio_modality_scale=None, guidance_rescale=0.0,
                          audio_guidance_rescale=None, max_sequence_length=128)


#: the tiny clips on one torch thread (tests/engine/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def t2v():
    theirs = diffusers.LTX2Pipeline.from_pretrained(embedded_folder("tiny-ltx2"),
                                                    local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    return theirs, load_pipeline("tiny-ltx2")


def reference(pipe, prompt: str, seed: int, frames: int = FRAMES, height: int = SIZE,
              width: int = SIZE, **kw) -> tuple[np.ndarray, np.ndarray]:
    """diffusers' frames as levels (F, H, W, 3) and waveform (channels, samples)."""
    video, audio = pipe(prompt=prompt, num_frames=frames, height=height, width=width,
                        frame_rate=FPS, num_inference_steps=STEPS, guidance_scale=3.0,
                        generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                        return_dict=False, **DIFFUSERS_SETTINGS, **kw)
    return (video[0] * 255).round().astype(np.int16), audio[0].float().numpy()


def request(prompt: str, seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt=prompt, request_id=f"{prompt}-{seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


def clip(pipe, joined: torch.Tensor, r: DiffusionRequest) -> tuple[np.ndarray, np.ndarray]:
    """A pipeline output (frames and waveform in one row) -> (levels, waveform)."""
    frames, waveform = split_sound(joined, pipe.prepared(r).sampling_params, 2)
    return quantize_images(frames)[0].numpy().astype(np.int16), waveform[0].numpy()


def assert_close(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray],
                 frames: int = MAX_DIFF, wave: float = MAX_WAVE_DIFF) -> None:
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert np.abs(got[0] - want[0]).max() <= frames
    assert np.abs(got[1] - want[1]).max() <= wave


def test_text_to_video_with_sound_alone_batched_and_stepped_matches_diffusers(t2v):
    theirs, ours = t2v
    requests = [request("a red fox in the snow", 0), request("a blue square on grass", 1)]
    expected = [reference(theirs, r.prompt, r.sampling_params.seed) for r in requests]
    alone = [ours.forward(DiffusionRequestBatch([r]))[0] for r in requests]
    batched = ours.forward(DiffusionRequestBatch(requests))
    steps = stepped(ours, requests)
    for r, want, *got in zip(requests, expected, alone, batched, steps, strict=True):
        assert want[0].shape == (FRAMES, SIZE, SIZE, 3)
        assert want[1].shape[0] == 2 and want[1].std() > 0.01  # stereo, not silence
        # 160 samples a mel frame at 16 kHz: about the clip's 9 / 24 s
        assert abs(want[1].shape[1] / 16000 - FRAMES / FPS) < 0.05
        for output in got:
            assert_close(clip(ours, output, r), want)
    # the prompt shows in the picture and in the sound
    assert np.abs(expected[0][0] - expected[1][0]).mean() > 1
    assert np.abs(expected[0][1] - expected[1][1]).mean() > 1e-3


def test_step_batched_with_another_frame_count_and_size_each_equal_alone(t2v):
    _, ours = t2v
    a = request("a red fox", 3)
    b = request("a red fox", 4, num_frames=5, height=64, width=32)
    solo = [clip(ours, stepped(ours, [r])[0], r) for r in (a, b)]
    together = stepped(ours, [a, b])
    assert clip(ours, together[1], b)[0].shape == (5, 64, 32, 3)
    for r, alone, shared in zip((a, b), solo, together, strict=True):
        assert_close(clip(ours, shared, r), alone, frames=1, wave=1e-5)


def test_image_to_video_from_a_first_frame_matches_diffusers():
    import PIL.Image

    theirs = diffusers.LTX2ImageToVideoPipeline.from_pretrained(
        embedded_folder("tiny-ltx2-i2v"), local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    ours = load_pipeline("tiny-ltx2-i2v")
    pixels = (np.random.default_rng(0).random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    first = PIL.Image.fromarray(pixels)
    # image_crf=0: diffrt conditions on the frame as given (no H.264 round trip)
    want = reference(theirs, "a red fox", 2, image=first, image_crf=0)
    r = DiffusionRequest(prompt="a red fox", request_id="i2v", images=[first],
                         sampling_params=SamplingParams(seed=2))
    got = ours.forward(DiffusionRequestBatch([r]))[0]
    assert_close(clip(ours, got, r), want)
    other = DiffusionRequest(prompt="a red fox", request_id="i2v-other",
                             images=[PIL.Image.fromarray(255 - pixels)],
                             sampling_params=SamplingParams(seed=2))
    changed = ours.forward(DiffusionRequestBatch([other]))[0]
    assert np.abs(clip(ours, changed, other)[0] - clip(ours, got, r)[0]).mean() > 1
    # stepped beside another first frame: each its own clip
    for req, alone, shared in zip((r, other), (got, changed), stepped(ours, [r, other]),
                                  strict=True):
        assert_close(clip(ours, shared, req), clip(ours, alone, req), frames=1, wave=1e-5)


def test_bad_values_and_unsupported_features_are_refused_naming_the_field():
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.sampling import InvalidRequestError

    spec = resolve_model_spec("tiny-ltx2")
    filled = spec.with_defaults(request("a fox", 0)).sampling_params
    assert (filled.num_frames, filled.fps, filled.height) == (FRAMES, FPS, SIZE)
    assert spec.sound and spec.frame_factor == 4
    spec.check(request("a fox", 0, num_frames=13, fps=25.0))
    for field, value, reason in (
            ("num_frames", 8, "4k \\+ 1"), ("height", 48, "multiple of 32"),
            ("output_type", "latent", "makes sound"), ("loras", {"a": 1.0}, "no LoRA"),
            ("cache", "first-block", "no 'first-block' step cache")):
        with pytest.raises(InvalidRequestError, match=reason) as info:
            spec.check(request("a fox", 0, **{field: value}))
        assert info.value.field == field
    assert spec.quantization == () and not spec.parallel.multi_rank


def test_engine_features_not_run_on_ltx2_are_refused_naming_the_field():
    from diffrt.engine.errors import EngineConfigError
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.parallel.degrees import ParallelConfigError, ParallelDegrees
    from diffrt.engine.settings import ModelConfig
    from diffrt.engine.setup_checks import check_offload
    from diffrt.platforms import current_platform

    spec = resolve_model_spec("tiny-ltx2")
    for degrees, vae_parallel in ((ParallelDegrees(cfg=2), False),
                                  (ParallelDegrees(ulysses=2), False), (ParallelDegrees(), True)):
        with pytest.raises(ParallelConfigError, match="one rank only") as info:
            spec.check_parallel(degrees, vae_parallel)
        assert info.value.field == "world_size"
    for offload in ("model", "layerwise"):
        with pytest.raises(EngineConfigError, match="video model") as err:
            check_offload(ModelConfig(model="tiny-ltx2", offload=offload), spec, current_platform)
        assert err.value.field == "offload"
    from diffrt.engine import EngineConfig

    for settings, field in (({"quantization": "int8"}, "quantization"),
                            ({"text_encoder_quantization": "int8"}, "text_encoder_quantization"),
                            ({"cfg_parallel_size": 2}, "world_size")):
        with pytest.raises(EngineConfigError) as err:
            EngineConfig(model="tiny-ltx2", **settings).model_spec()
        assert err.value.field == field


def test_clips_of_other_frame_rates_never_share_a_batched_forward():
    """fps sets a clip's audio length and positions; one request-batch
    forward takes them from its first request, so fps is in the batch key
    (in step batching the latent size, which counts the audio, keeps them
    apart)."""
    from diffrt.engine.models.registry import resolve_model_spec

    spec = resolve_model_spec("tiny-ltx2")

    def key(fps: float) -> tuple:
        return spec.request_batch_key(spec.with_defaults(DiffusionRequest(
            "a", sampling_params=SamplingParams(fps=fps))))

    assert key(24.0) == key(24.0)
    assert key(24.0) != key(12.0)
