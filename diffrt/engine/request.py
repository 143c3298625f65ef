"""The request a user submits: a msgspec Struct so it travels to workers as is."""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from diffrt.engine.input_images import check_kinds
from diffrt.engine.sampling import InvalidRequestError, SamplingParams

#: what a request asks by its inputs alone (an editing model reads images as
#: an edit: ``ModelSpec.task_of``)
InputTask = Literal["text-to-image", "image-to-image", "inpainting"]

MAX_REQUEST_ID_CHARS = 256
#: prompts and negative prompts, in UTF-8 bytes (text encoders keep far fewer tokens).
MAX_PROMPT_BYTES = 64 * 1024


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def _check_text(field: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        kind = "a str or None" if optional else "a str"
        raise InvalidRequestError(field, f"must be {kind}, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            field, f"must be valid Unicode text (a lone surrogate at position {exc.start})"
        ) from None
    if size > MAX_PROMPT_BYTES:
        raise InvalidRequestError(
            field, f"must be at most {MAX_PROMPT_BYTES} bytes of UTF-8, got {size}")


class DiffusionRequest(msgspec.Struct):
    """One prompt, its input images and its sampling parameters.

    `request_id` is generated when not given (or given as None); the engine
    refuses a duplicate id while the first request with that id is still active.

    ``images`` (PIL images or numpy arrays) and ``mask_image`` mean what
    diffusers makes of them for the model's folder: image-to-image with
    ``SamplingParams.strength`` on a text-to-image model, inpainting with a
    mask (white: repaint), an edit on an editing model (``ModelSpec.tasks``).
    The engine converts them at submission (``engine.input_images``) and its
    accepted copy holds ``InputHandle``s into shared memory instead: images
    never travel inside a message.
    """

    prompt: str
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str = msgspec.field(default_factory=new_request_id)
    negative_prompt: str | None = None
    images: list[Any] = msgspec.field(default_factory=list)
    mask_image: Any = None

    def __post_init__(self) -> None:
        if self.request_id is None:
            self.request_id = new_request_id()
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt", f"must be a str, got {type(self.prompt).__name__}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError("negative_prompt", "must be a str or None")

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that cannot be carried
        to a worker and back (the model's own limits are its ``ModelSpec.check``)."""
        rid = self.request_id
        if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                "request_id", f"must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} "
                f"characters, got {rid!r:.80}")
        _check_text("request_id", rid, optional=False)
        _check_text("prompt", self.prompt, optional=False)
        _check_text("negative_prompt", self.negative_prompt, optional=True)
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params",
                f"must be a SamplingParams, got {type(self.sampling_params).__name__}")
        check_kinds(self.images, self.mask_image)
        if self.sampling_params.strength is not None and not self.images:
            raise InvalidRequestError("strength", "applies to an input image (images) only")

    @property
    def task(self) -> InputTask:
        """What the request asks by its inputs alone: "text-to-image",
        "image-to-image" (images) or "inpainting" (images and a mask); an
        editing model reads images as an edit (``ModelSpec.task_of``)."""
        if not self.images:
            return "text-to-image"
        return "inpainting" if self.mask_image is not None else "image-to-image"


class OfRequest:
    """What a holder of one request (``request``) reads of it: the engine's
    ``RequestRecord`` and the worker's ``StepRequestState`` alike."""

    request: DiffusionRequest

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_steps(self) -> int:
        """The denoise steps it runs (``SamplingParams.denoise_steps``)."""
        return self.request.sampling_params.denoise_steps()

