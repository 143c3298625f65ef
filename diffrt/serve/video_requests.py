"""A video body as the engine request it asks for, checked before its job
is created (so a bad one is a 400 naming the body's field, not a failed
job): ``seconds`` and ``fps`` as a frame count (``num_frames = seconds x fps
+ 1``: Wan's 81 frames at 16 fps are "5" seconds), ``size`` as height and
width, ``input_reference`` as the first frame (an image-to-video folder's
input image; a text-to-video one refuses it by name). What the model
refuses (its frame counts, sizes, steps) is the model's own check
(``ModelSpec.check``), reworded with the body's names."""

from __future__ import annotations

from typing import Any

from diffrt.engine import DiffusionRequest, InvalidRequestError, SamplingParams
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.video_chunks import chunked_frames
from diffrt.serve.error_mapping import ImageRoute, invalid
from diffrt.serve.errors import ApiError
from diffrt.serve.video_protocol import VIDEO_FIELDS, VideoCreateRequest

#: the body's names of the engine's fields (refusals are reworded with them)
VIDEO_ROUTE = ImageRoute("video", {"images": "input_reference", "height": "size",
                                   "width": "size"})


class VideoPlan:
    """What a checked body runs: the engine request and the job's
    ``seconds``, ``size`` and frame count as the model resolved them."""

    def __init__(self, request: DiffusionRequest, spec: ModelSpec):
        self.request = request
        params = spec.with_defaults(request).sampling_params
        self.num_frames = params.num_frames or 1
        self.fps = params.fps or 1.0
        self.height, self.width = params.height or 0, params.width or 0
        self.seconds = f"{(self.num_frames - 1) / self.fps:g}"
        self.size = f"{self.width}x{self.height}"


def plan_video(body: VideoCreateRequest, request_id: str, spec: ModelSpec, *,
               step_execution: bool, first_frame: Any = None) -> VideoPlan:
    """The checked engine request of ``body`` (``first_frame``: a PIL image)."""
    if first_frame is not None and spec.max_input_images < 1:
        raise ApiError(400, f"input_reference: {spec.name} makes video from text only; serve "
                            "an image-to-video folder (e.g. tiny-wan-i2v) for a first frame",
                       param="input_reference", code="invalid_value")
    fields: dict[str, Any] = {}
    for f in VIDEO_FIELDS:
        value = getattr(body, f.http)
        fields[f.field] = value / f.scale if value is not None and f.scale != 1.0 else value
    if body.size is not None:
        width, _, height = body.size.partition("x")
        fields["height"], fields["width"] = int(height), int(width)
    fps = body.fps if body.fps is not None else spec.defaults.fps
    fields["fps"] = body.fps
    fields["num_frames"] = body.num_frames
    if body.seconds is not None and fps:  # (a video model's defaults have one)
        fields["num_frames"] = round(float(body.seconds) * fps) + 1
    if step_execution:
        fields["partial_images"] = 0
    request = DiffusionRequest(prompt=body.prompt, negative_prompt=body.negative_prompt,
                               request_id=request_id, sampling_params=SamplingParams(**fields),
                               images=[] if first_frame is None else [first_frame])
    try:
        spec.check(request)
    except InvalidRequestError as exc:
        if exc.field == "num_frames" and body.seconds is not None:
            raise _bad_seconds(body.seconds, fps or 1.0, spec) from None
        raise invalid(exc, VIDEO_ROUTE) from None
    return VideoPlan(request, spec)


def _bad_seconds(seconds: str, fps: float, spec: ModelSpec) -> ApiError:
    f = spec.frame_factor
    if spec.chunk_latent_frames:  # a chunked model's: what whole chunks give
        allowed = ", ".join(f"{(chunked_frames(k, spec.chunk_latent_frames, f) - 1) / fps:g}"
                            for k in range(1, 4))
        return ApiError(400, f"seconds: {spec.name} makes clips of whole chunks at {fps:g} fps "
                             f"({allowed}, ...; or give num_frames), got {seconds!r}",
                        param="seconds", code="invalid_value")
    step = f / fps
    longest = (spec.max_frames - 1) / fps
    return ApiError(400, f"seconds: {spec.name} makes clips of a multiple of {step:g} s at "
                         f"{fps:g} fps ({step:g}, {2 * step:g}, ... up to {longest:g}), "
                         f"got {seconds!r}", param="seconds", code="invalid_value")


__all__ = ["VIDEO_ROUTE", "VideoPlan", "plan_video"]
