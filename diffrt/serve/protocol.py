"""The HTTP API's bodies, as OpenAI's Images API shapes them (pydantic models:
FastAPI validates with them and publishes them in /openapi.json).

``ImageGenerationRequest`` takes OpenAI's fields, accepts and ignores those
that have no meaning for a diffusion model (``quality``, ``background``,
``moderation``, ``style``, ``complexity``, ``safety_identifier``), adds
diffrt's extensions at the top level (what the ``openai`` client's
``extra_body`` sends) and refuses any other field by name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: upper bound of a prompt in characters (the engine's own limit may be lower)
MAX_PROMPT_CHARS = 32_000


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    n: int = Field(1, ge=1, le=10, description="images for the prompt (1-10)")
    size: str = Field("auto", max_length=32,
                      description='"WxH" in pixels, or "auto" for the model\'s default')
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(
        None, ge=0, le=100, description="jpeg/webp quality, 0-100 (default 100)")
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    partial_images: int = Field(0, ge=0, le=3,
                                description="previews streamed before the image (stream only)")

    # OpenAI fields without meaning here: accepted, ignored.
    quality: str | None = Field(None, max_length=32, description="accepted, ignored")
    background: str | None = Field(None, max_length=32, description="accepted, ignored")
    moderation: str | None = Field(None, max_length=32, description="accepted, ignored")
    style: str | None = Field(None, max_length=32, description="accepted, ignored")
    complexity: str | None = Field(None, max_length=32, description="accepted, ignored")
    safety_identifier: str | None = Field(None, max_length=256, description="accepted, ignored")

    # diffrt's extensions
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0, le=1000)
    true_cfg_scale: float | None = Field(None, ge=0, le=1000)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream_progress: bool = Field(False, description="stream step-progress events (stream only)")


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class Timings(BaseModel):
    """Seconds spent by the request in each phase (None: the phase did not happen)."""

    queue: float | None = None
    inference: float | None = None
    output: float | None = None
    total: float | None = None


class DiffrtInfo(BaseModel):
    """diffrt's extension of the response."""

    request_id: str
    seed: int | None
    num_inference_steps: int
    timings: Timings


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    diffrt: DiffrtInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffrt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
