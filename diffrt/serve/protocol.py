"""The HTTP API's bodies, as OpenAI's Images API shapes them (pydantic models:
FastAPI validates with them and publishes them in /openapi.json).

``ImageGenerationRequest`` takes OpenAI's fields, accepts and ignores those
that have no meaning for a diffusion model (``quality``, ``background``,
``moderation``, ``style``, ``complexity``, ``safety_identifier``), adds
diffrt's extensions at the top level (what the ``openai`` client's
``extra_body`` sends) and refuses any other field by name. Its sampling
fields are made from ``SamplingParams``' declarations, with OpenAI's names
where OpenAI has one (``n``; ``size`` for height and width; ``*_ms`` for a
``*_s`` field), so the body, the engine and the CLI accept the same values.

``ImageEditForm`` is the same body for ``/v1/images/edits``, with the
sampling fields that need an input image (``strength``: declared
``needs_image``) and OpenAI's edit-only ``input_fidelity`` (ignored); it is
what a multipart body's text fields are read as. ``ImageEditRequest`` adds
the JSON body's images (``images``, ``mask``: ``data:`` URLs), which a
multipart body sends as file parts instead (``edit_body.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from diffrt.engine.declarations import Declared, declared_fields
from diffrt.engine.input_images import MAX_INPUT_IMAGES
from diffrt.engine.sampling import SamplingParams

#: upper bound of a prompt in characters (the engine's own limit may be lower)
MAX_PROMPT_CHARS = 32_000


class _ImageGenerationBody(BaseModel):
    """POST /v1/images/generations: OpenAI's own fields, the request's texts,
    and the fields OpenAI has that mean nothing here (accepted, ignored). The
    sampling fields are added from their declarations (``SAMPLING_FIELDS``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    size: str = Field("auto", max_length=32,
                      description='"WxH" in pixels, or "auto" for the model\'s default')
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(
        None, ge=0, le=100, description="jpeg/webp quality, 0-100 (default 100)")
    user: str | None = Field(None, max_length=256)
    stream: bool = False

    # OpenAI fields without meaning here: accepted, ignored.
    quality: str | None = Field(None, max_length=32, description="accepted, ignored")
    background: str | None = Field(None, max_length=32, description="accepted, ignored")
    moderation: str | None = Field(None, max_length=32, description="accepted, ignored")
    style: str | None = Field(None, max_length=32, description="accepted, ignored")
    complexity: str | None = Field(None, max_length=32, description="accepted, ignored")
    safety_identifier: str | None = Field(None, max_length=256, description="accepted, ignored")

    # diffrt's extensions that are not sampling fields
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    stream_progress: bool = Field(False, description="stream step-progress events (stream only)")


@dataclass(frozen=True)
class BodyField:
    """How one SamplingParams field is spelt in the HTTP body."""

    field: str            # the SamplingParams name
    http: str             # the body's name
    scale: float = 1.0    # body value = engine value x scale (``*_ms`` <-> ``*_s``)


def _http_name(declared: Declared) -> str | None:
    """The body's name of a sampling field: its declared one ("" the same;
    None: it has no meaning over HTTP). height and width travel as ``size``."""
    http = declared.extra.get("http", "")
    if http is None or http == "size":
        return None
    return http or declared.name


def _scale(declared: Declared, name: str) -> float:
    """A body field named ``*_ms`` for an engine field ``*_s`` carries milliseconds."""
    return 1000.0 if name.endswith("_ms") and declared.name.endswith("_s") else 1.0


def _python_type(declared: Declared) -> Any:
    """The body's type of a declaration's kind; a choice is the Literal of its
    values, so pydantic refuses another value naming the field."""
    if declared.kind == "choice":
        return Literal[declared.choices]  # Literal[("a", "b")] is Literal["a", "b"]
    # the one mapping among the sampling fields is ``loras``: adapter name -> scale;
    # the one sequence ``seeds``: ints
    return {"int": int, "float": float, "str": str, "bool": bool,
            "mapping": dict[str, float], "sequence": list[int]}[declared.kind]


def _body_field(declared: Declared, name: str) -> tuple[Any, Any]:
    """A pydantic field with the declaration's type, limits and default."""
    scale = _scale(declared, name)
    python = _python_type(declared)
    # limits beside other keywords of pydantic's overloaded Field: mypy cannot
    # tell which overload a ** of them reaches
    bounds: dict[str, Any] = {k: v * scale if scale != 1.0 and k in ("ge", "gt", "le", "lt") else v
              for k, v in declared.bounds.items()}
    annotation: Any = python | None if declared.optional else python
    default = None if declared.optional else declared.default
    return annotation, Field(default, description=declared.description, **bounds)


#: the sampling fields a body may carry (the edit body all of them), and their body names
_DECLARED = {d.name: d for d in declared_fields(SamplingParams)}
SAMPLING_FIELDS: tuple[BodyField, ...] = tuple(
    BodyField(d.name, name, _scale(d, name))
    for d in _DECLARED.values() if (name := _http_name(d)) is not None)
#: those that mean something without an input image: the generation body's
GENERATION_FIELDS: tuple[BodyField, ...] = tuple(
    f for f in SAMPLING_FIELDS if not _DECLARED[f.field].extra.get("needs_image"))
#: body names of the fields only an edit carries (a generation naming one is
#: told where it belongs)
EDIT_ONLY_FIELDS: frozenset[str] = frozenset(
    f.http for f in SAMPLING_FIELDS if f not in GENERATION_FIELDS)


class _ImageEditBody(_ImageGenerationBody):
    """POST /v1/images/edits: the generation body, and OpenAI's edit field that
    means nothing here."""

    input_fidelity: str | None = Field(None, max_length=32, description="accepted, ignored")


#: a JSON body's input image: a ``data:`` URL (base64), or OpenAI's
#: ``{"image_url": <data URL>}``; the server never fetches a remote URL
ImageInput = str | dict[str, str]
_IMAGE_HELP = ('a data: URL with the image base64-encoded ("data:image/png;base64,..."), '
               'or {"image_url": <that URL>}; remote URLs are refused')

if TYPE_CHECKING:
    class ImageGenerationRequest(_ImageGenerationBody):
        """What a type checker sees of the model made below: the sampling
        fields are read by name (``SAMPLING_FIELDS``), except ``n``, which the
        route checks against ``stream`` itself."""

        n: int

    class ImageEditForm(_ImageEditBody):
        n: int

    class ImageEditRequest(ImageEditForm):
        images: list[ImageInput]
        mask: ImageInput | None
else:
    ImageGenerationRequest = create_model(
        "ImageGenerationRequest", __base__=_ImageGenerationBody,
        __doc__="POST /v1/images/generations (OpenAI's fields, then the sampling fields).",
        **{f.http: _body_field(_DECLARED[f.field], f.http) for f in GENERATION_FIELDS})
    ImageEditForm = create_model(
        "ImageEditForm", __base__=_ImageEditBody,
        __doc__="POST /v1/images/edits as multipart/form-data: the text fields (the images "
                "are file parts: image, image[], mask).",
        **{f.http: _body_field(_DECLARED[f.field], f.http) for f in SAMPLING_FIELDS})
    ImageEditRequest = create_model(
        "ImageEditRequest", __base__=ImageEditForm,
        __doc__="POST /v1/images/edits as JSON: the images as data: URLs.",
        images=(list[ImageInput], Field(min_length=1, max_length=MAX_INPUT_IMAGES,
                                        description="the images to edit: " + _IMAGE_HELP)),
        mask=(ImageInput | None, Field(None, description=(
            "where to edit the first image, as large as it: with an alpha channel, fully "
            "transparent pixels (OpenAI's convention); without one, white (diffusers'); "
            + _IMAGE_HELP))))


#: the bodies that ask for images (their shared fields: what the routes read)
ImageBody = ImageGenerationRequest | ImageEditForm


def body_fields(fields: tuple[BodyField, ...]) -> dict[str, tuple[Any, Any]]:
    """pydantic fields for ``fields`` (body name -> type and Field), made
    from their declarations as the image bodies' are: for another body that
    carries sampling fields (the videos', ``video_protocol.py``)."""
    return {f.http: _body_field(_DECLARED[f.field], f.http) for f in fields}


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class Timings(BaseModel):
    """Seconds spent by the request in each phase (None: the phase did not happen)."""

    queue: float | None = None
    inference: float | None = None
    output: float | None = None
    total: float | None = None


class CacheInfo(BaseModel):
    """What the request's step cache did (the engine's ``CacheMetrics``)."""

    policy: str = Field(description='"first-block" or "teacache"')
    threshold: float
    steps_computed: int = Field(description="denoise steps that ran the cached blocks")
    steps_reused: int = Field(description="denoise steps that reused their output")
    reused_steps: list[int] = Field(description="the 0-based denoise steps that reused")
    uncached_reason: str | None = Field(None, description=(
        'why it ran uncached although it asked for a cache ("cache_state_bytes": its state '
        "would not fit the server's cache_state_bytes); null: it did not"))


class RolloutRef(BaseModel):
    """Where a request's log-probs and trajectory wait (``return_log_probs``,
    ``return_trajectory``): a safetensors file at ``url`` (``GET
    /v1/rollouts/{id}``, with the API key that made it) until ``expires_at``."""

    id: str
    object: Literal["rollout"] = "rollout"
    url: str
    bytes: int = Field(description="the file's size")
    weights_version: int | str = Field(description="the transformer weights it ran on")
    tensors: list[str] = Field(description=(
        "the file's tensors: log_probs (n, T) float32, latents (n, T + 1, C, h, w), "
        "timesteps (T,), sigmas (T + 1,); row i is the response's data[i]"))
    expires_at: int = Field(description="Unix seconds after which it is gone (404)")


class DiffrtInfo(BaseModel):
    """diffrt's extension of the response."""

    request_id: str
    seed: int | None
    num_inference_steps: int
    timings: Timings
    #: absent (null in a stream's event) when the request ran without a step cache
    cache: CacheInfo | None = None
    #: the transformer weights' version it ran on (``POST /v1/weights``)
    weights_version: int | str = 0
    #: each output's seed, when the request gave ``seeds``
    seeds: list[int] | None = None
    #: its adapters' versions by name (``PUT /v1/loras/{name}``), when it named any
    lora_versions: dict[str, int | str] | None = None
    #: its log-probs and trajectory's download, when it asked for them
    rollout: RolloutRef | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    diffrt: DiffrtInfo


class ModelInfo(BaseModel):
    """diffrt's extension of a model card: what the model's ``ModelSpec``
    says a request may ask and gets by default."""

    family: str
    tasks: list[str]
    max_input_images: int = Field(description="images one edit may give (0: no edits)")
    size_multiple: int
    max_size: int
    max_steps: int
    defaults: dict[str, Any]
    default_negative_prompt: str | None
    cfg_rule: str
    step_execution: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffrt"
    diffrt: ModelInfo | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoraRegistration(BaseModel):
    """POST /v1/loras: an adapter file (or folder) to register under ``name``;
    a relative ``path`` is taken inside the server's ``--lora-dir``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1, max_length=4096)


class LoraCard(BaseModel):
    """A registered adapter (the engine's ``LoraInfo``)."""

    name: str
    path: str
    rank: int = Field(description="the largest rank of its modules")
    modules: int = Field(description="the linear layers it changes")
    nbytes: int = Field(description="its factors' bytes in host memory, in each worker")
    requests: int = Field(description="requests accepted with it since it was registered")
    active: int = Field(description="requests holding it now (queued or running)")
    slot: int | None = Field(description="its device slot now (null: on the host only)")
    version: int | str = Field(0, description=(
        "its factors' version: 0 as registered, then PUT /v1/loras/{name}'s"))


class LoraUpdateBody(BaseModel):
    """PUT /v1/loras/{name}: the adapter's new factors. As JSON, ``path``: an
    adapter file (or folder) inside the server's ``--lora-dir``; as
    multipart/form-data, a ``file`` part (a safetensors file of PEFT's names,
    as diffusers saves an adapter) and these text fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: str | None = Field(None, min_length=1, max_length=4096)
    version: int | str | None = Field(None, description=(
        "the new version's name (default: the current one plus one; in a form, ASCII "
        "digits are a number)"))


class WeightsUpdateBody(LoraUpdateBody):
    """POST /v1/weights: the transformer's new weights. As JSON, ``path``: a
    safetensors file or a folder of them inside the server's ``--weights-dir``;
    as multipart/form-data, a ``file`` part (a safetensors file of the
    transformer's parameter names) and these text fields."""

    policy: Literal["wait", "abort"] = Field("wait", description=(
        "the requests running when it arrives: wait (they finish on their weights, new ones "
        "wait) or abort (they are aborted at their next step)"))


class WeightsUpdated(BaseModel):
    """POST /v1/weights' answer: the version new requests run on, and the
    checksums (CRC-32 of names, dtypes, shapes and bytes) of the source and
    of what each rank loaded (equal: a rank that read otherwise refuses it)."""

    object: Literal["weights"] = "weights"
    version: int | str
    checksum: str
    rank_checksums: list[str]
    #: Ray Serve: each model replica's checksum of what it applied, by replica
    replica_checksums: dict[str, str] | None = None


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
