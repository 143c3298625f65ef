"""The Helios family against diffusers' own ``HeliosPipeline`` on the
embedded tiny folder (float32, same seed; chunks of 2 latent frames, so 5
frames a chunk): each chunk streamed by the step protocol equals
diffusers' frames of that chunk, and the whole clip equals diffusers' in
request-batch and step execution; step-batched beside a request of another
length and size, each equals its run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE, STEPS, CHUNK = 32, 2, 2  # tiny-helios' defaults: 2 latent frames a chunk
WINDOW = (CHUNK - 1) * 4 + 1  # the frames one chunk decodes to
MAX_DIFF = 2  # of 255 per frame, float32


@pytest.fixture(scope="module")
def helios():
    theirs = diffusers.HeliosPipeline.from_pretrained(embedded_folder("tiny-helios"),
                                                      local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    return theirs, load_pipeline("tiny-helios")


def reference(pipe, prompt: str, seed: int, frames: int, height: int = SIZE,
              width: int = SIZE) -> np.ndarray:
    video = pipe(prompt=prompt, num_frames=frames, height=height, width=width,
                 num_inference_steps=STEPS, num_latent_frames_per_chunk=CHUNK,
                 generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
    return (video * 255).round().astype(np.int16)


def request(seed: int, **params) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red fox", request_id=f"fox-{seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


def levels(video: torch.Tensor) -> np.ndarray:
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) levels, as the engine quantises them."""
    return quantize_images(video)[0].numpy().astype(np.int16)


def stepped(pipe, requests: list[DiffusionRequest]) -> tuple[list[np.ndarray], list[list]]:
    """The step protocol as the worker runs it: every unfinished request in
    each step (they leave as they finish), a chunk's preview taken at each
    of its preview steps. Returns each request's clip and streamed chunks."""
    states = [StepRequestState(request=r) for r in requests]
    pipe.prepare_encode_batch(states)
    chunks: list[list] = [[] for _ in states]
    clips: dict[int, np.ndarray] = {}
    while len(clips) < len(states):
        running = [i for i, s in enumerate(states) if i not in clips]
        batch = [states[i] for i in running]
        for i, s, p in zip(running, batch,
                           pipe.split_predictions(pipe.denoise_step(batch), batch), strict=True):
            pipe.apply_step(s, p)
            if s.finished:
                clips[i] = levels(pipe.post_decode_batch([s])[0])
            elif s.step in s.request.sampling_params.preview_steps():
                chunks[i].append(levels(pipe.decode_preview(s)))
    return [clips[i] for i in range(len(states))], chunks


def test_streamed_chunks_and_the_clip_match_diffusers_in_both_modes(helios):
    theirs, ours = helios
    r = request(0, num_frames=13)  # 3 chunks of 5 frames, cut to 13
    want = reference(theirs, "a red fox", 0, 13)
    assert want.shape == (13, SIZE, SIZE, 3)
    [clip], [chunks] = stepped(ours, [r])
    assert len(chunks) == 2  # the first two stream; the last is in the clip
    for k, chunk in enumerate(chunks):
        assert chunk.shape == (WINDOW, SIZE, SIZE, 3)
        assert np.abs(chunk - want[k * WINDOW:(k + 1) * WINDOW]).max() <= MAX_DIFF
    assert np.abs(clip - want).max() <= MAX_DIFF
    whole = levels(ours.forward(DiffusionRequestBatch([r]))[0])
    assert np.abs(whole - want).max() <= MAX_DIFF
    assert np.abs(want[:WINDOW] - want[WINDOW:2 * WINDOW]).mean() > 1  # chunks differ


def test_step_batched_beside_another_length_and_size_each_equal_alone(helios):
    _, ours = helios
    a = request(1, num_frames=13)
    b = request(2, num_frames=9, height=48, width=SIZE)
    (solo_a,), _ = stepped(ours, [a])
    (solo_b,), _ = stepped(ours, [b])
    (clip_a, clip_b), (chunks_a, chunks_b) = stepped(ours, [a, b])
    assert clip_b.shape == (9, 48, SIZE, 3) and len(chunks_a) == 2 and len(chunks_b) == 1
    assert np.abs(clip_a - solo_a).max() <= 1 and np.abs(clip_b - solo_b).max() <= 1
    assert np.abs(chunks_b[0] - solo_b[:WINDOW]).max() <= 1


def test_first_chunk_inputs_are_what_diffusers_gives_a_first_chunk(helios):
    """``history.first_chunk_inputs`` (what a call outside the pipeline passes:
    the motion model's training and probe) equals the history inputs and
    frame indices diffusers' HeliosPipeline gives its transformer for a
    text-to-video request's first chunk."""
    from diffrt.engine.pipelines.helios.history import first_chunk_inputs

    theirs, _ = helios
    calls: list[dict] = []
    hook = theirs.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(dict(kw)), with_kwargs=True)
    try:
        reference(theirs, "a red fox", 0, WINDOW)  # one chunk
    finally:
        hook.remove()
    given = calls[0]
    ours = first_chunk_inputs(given["hidden_states"])
    assert set(ours) <= set(given)
    for name, value in ours.items():
        assert value.shape == given[name].shape and torch.equal(value, given[name]), name
