"""The request a user submits: a msgspec Struct so it travels to workers as is."""

from __future__ import annotations

import uuid

import msgspec

from diffrt.engine.sampling import InvalidRequestError, SamplingParams


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


class DiffusionRequest(msgspec.Struct):
    """One prompt and its sampling parameters.

    `request_id` is generated when not given; the engine refuses a duplicate
    id while the first request with that id is still active.
    """

    prompt: str
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str | None = None
    negative_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.request_id is None:
            self.request_id = new_request_id()
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt", f"must be a str, got {type(self.prompt).__name__}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError("negative_prompt", "must be a str or None")
