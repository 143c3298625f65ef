"""The bodies of OpenAI's videos API (``/v1/videos``), as the ``openai``
package 3.x sends and reads them (``resources/videos.py``,
``types/video*.py``), in pydantic models as the images API's
(``protocol.py``): FastAPI validates with them and publishes them.

``VideoCreateRequest`` is ``POST /v1/videos``, as the ``openai`` client
sends it (multipart: text fields, read leniently as form text is, and
``input_reference`` a file part, which the body's reader keeps apart, or
``input_reference[image_url]`` text) or as JSON (strict types;
``input_reference`` a ``data:`` URL or OpenAI's ``{"image_url": ...}``):
``read_video_fields``. OpenAI's fields come first: ``prompt``, ``model``,
``seconds``, ``size``; diffrt's own sit beside them at the top level (what
``extra_body`` sends), as in the images API: the sampling fields a clip
takes, made from ``SamplingParams``' declarations (seed, steps, guidance,
priority, cache, loras, timeouts; not ``n``, ``partial_images`` or an
edit's ``strength``), ``negative_prompt``, and the clip's ``num_frames``
and ``fps``. ``seconds`` and ``size`` are checked for form only here (a
positive number of seconds, ``"WxH"``): which values a model takes is the
model's (its folder's), not Sora's fixed sets. Any other field is refused
by name; every refusal is OpenAI's error shape naming the field as
``param`` (``errors.py``).

``VideoObject`` is OpenAI's job object (``VideoJob.public()``),
``VideoList`` a cursor page, ``VideoDeleted`` a deletion's answer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic_core import PydanticCustomError

from diffrt.serve.protocol import (
    EDIT_ONLY_FIELDS,
    MAX_PROMPT_CHARS,
    SAMPLING_FIELDS,
    BodyField,
    ImageInput,
    body_fields,
)
from diffrt.serve.video_jobs import MAX_PAGE, Status, Variant

#: the most frames and the highest frame rate a body may ask for (the
#: engine's own bounds for a clip; a model's may be lower)
MAX_VIDEO_FRAMES = 1025
MAX_VIDEO_FPS = 240.0
#: the longest clip ``seconds`` may name
MAX_VIDEO_SECONDS = 3600.0
#: the sampling fields a clip takes (an image's count, previews and an
#: edit's strength are not a video's)
VIDEO_FIELDS: tuple[BodyField, ...] = tuple(
    f for f in SAMPLING_FIELDS if f.http not in ("n", "partial_images", *EDIT_ONLY_FIELDS))


def _invalid(message: str) -> PydanticCustomError:
    """A refusal whose message is ``message`` as is (``errors.py`` adds "field: ")."""
    return PydanticCustomError("invalid_value", message)


class _VideoCreateBody(BaseModel):
    """POST /v1/videos: OpenAI's fields and diffrt's texts and clip; the
    sampling fields are added from their declarations (``VIDEO_FIELDS``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(None, max_length=256)
    seconds: str | None = Field(None, max_length=16, description=(
        'the clip\'s length in seconds, as OpenAI sends it ("4"; a number is taken too); '
        "the model's values, not Sora's; with fps it sets num_frames; None: the model's"))
    size: str | None = Field(None, max_length=32, description=(
        '"WxH" in pixels (the model\'s sizes, not Sora\'s); None: the model\'s default'))
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    num_frames: int | None = Field(None, ge=1, le=MAX_VIDEO_FRAMES, description=(
        "frames of the clip, of the form the model needs (Wan: 4k + 1); instead of "
        "seconds; None: from seconds, else the model's"))
    fps: float | None = Field(None, gt=0, le=MAX_VIDEO_FPS, description=(
        "the clip's frames per second; None: the model's"))

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        """A positive number of seconds, as text ("4", "2.5") or a number;
        kept as OpenAI's text."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _invalid('must be a number of seconds as a string, e.g. "4"')
        try:
            number = float(value)
        except ValueError:
            raise _invalid(f'must be a number of seconds, e.g. "4", got {str(value)[:20]!r}') \
                from None
        if not (math.isfinite(number) and 0 < number <= MAX_VIDEO_SECONDS):
            raise _invalid(f"must be > 0 and <= {MAX_VIDEO_SECONDS:g}, got {number:g}")
        return value if isinstance(value, str) else f"{number:g}"

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is None:
            return None
        width, x, height = value.partition("x")
        if not (x and width.isascii() and height.isascii() and width.isdigit()
                and height.isdigit() and 0 < len(width) <= 5 and 0 < len(height) <= 5):
            raise _invalid(f'must be "WxH" in pixels, e.g. "832x480", got {value[:32]!r}')
        return value

    @field_validator("num_frames")
    @classmethod
    def _frames_or_seconds(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("seconds") is not None:
            raise _invalid("give seconds or num_frames, not both")
        return value


    @field_validator("input_reference", mode="before", check_fields=False)
    @classmethod
    def _reference(cls, value: Any) -> Any:
        """A data: URL, or OpenAI's ``{"image_url": ...}`` (its ``file_id``
        names a file in OpenAI's storage: none here)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, dict) and set(value) == {"image_url"} \
                and isinstance(value["image_url"], str):
            return value
        if isinstance(value, dict) and "file_id" in value:
            raise _invalid("file ids are not served here; send the image as a data: URL")
        raise _invalid('must be a data: URL ("data:image/png;base64,...") or '
                       '{"image_url": <that URL>} (a file part in a multipart body)')


_REFERENCE_HELP = ("the clip's first frame (image-to-video): a data: URL with the image "
                   'base64-encoded, or {"image_url": <that URL>}; remote URLs and file ids '
                   "are refused")

if TYPE_CHECKING:
    class VideoCreateRequest(_VideoCreateBody):
        """What a type checker sees of the model made below: the sampling
        fields are read by name (``VIDEO_FIELDS``)."""

        input_reference: ImageInput | None
else:
    VideoCreateRequest = create_model(
        "VideoCreateRequest", __base__=_VideoCreateBody,
        __doc__="POST /v1/videos (multipart/form-data as the openai client sends it, or "
                "JSON): OpenAI's fields, then diffrt's.",
        input_reference=(ImageInput | None, Field(None, description=_REFERENCE_HELP)),
        **body_fields(VIDEO_FIELDS))


def read_video_fields(fields: Any, *, form: bool) -> VideoCreateRequest:
    """``fields`` (a JSON object, or a form's text fields, ``name[key]``
    parts already made mappings) as the create body: a form's leniently
    (text for numbers), JSON's strictly. A refusal is FastAPI's
    ``RequestValidationError``, which the server answers as OpenAI's 400
    naming the field."""
    try:
        return VideoCreateRequest.model_validate(fields, strict=not form)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


class VideoRemixRequest(BaseModel):
    """POST /v1/videos/{id}/remix: a new job with the finished one's settings
    and this prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)


class VideoListQuery(BaseModel):
    """GET /v1/videos's query: OpenAI's cursor."""

    model_config = ConfigDict(extra="forbid")

    after: str | None = Field(None, max_length=64, description=(
        "the last id of the previous page"))
    limit: int = Field(20, ge=1, le=MAX_PAGE)
    order: Literal["asc", "desc"] = Field("desc", description="by creation time")


class VideoContentQuery(BaseModel):
    """GET /v1/videos/{id}/content's query."""

    model_config = ConfigDict(extra="forbid")

    variant: Variant = Field("video", description=(
        "video: the MP4; thumbnail: its first frame (PNG); spritesheet: frames on one image"))


class VideoErrorBody(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """OpenAI's video job (``openai.types.Video``)."""

    id: str
    object: Literal["video"] = "video"
    status: Status
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    seconds: str
    size: str
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    error: VideoErrorBody | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


__all__ = ["MAX_VIDEO_FPS", "MAX_VIDEO_FRAMES", "MAX_VIDEO_SECONDS", "VIDEO_FIELDS",
           "VideoContentQuery", "VideoCreateRequest", "VideoDeleted",
           "VideoErrorBody", "VideoList", "VideoListQuery", "VideoObject", "VideoRemixRequest",
           "read_video_fields"]
