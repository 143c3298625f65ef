"""ModelSpec: one immutable description of a model, read by every room that
needs to know what the model accepts.

A spec is resolved once from a model folder (``models.registry``) without
loading weights, and it is plain data: a msgspec Struct, so the worker
receives the same object in its settings. Submission (defaults, limits, the
run-time estimate's shape), the schedulers (batch keys), the CLI's input
check, the server's defaults and ``/v1/models``, and post-processing read it; the pipeline object in each
worker is compute only and consults the same spec for the request-level
decisions it shares with the engine (whether CFG runs, the negative prompt).

The few decisions that depend on a request are data too, evaluated here:
``cfg_rule`` says when classifier-free guidance runs, ``request_batch_fields``
and ``step_batch_fields`` name the sampling fields two requests must agree
on to share one forward or one denoise step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Literal

import msgspec

from diffrt.engine.cache.policies import DEFAULT_THRESHOLDS, TEACACHE, CachePlan
from diffrt.engine.parallel.degrees import ParallelConfigError, ParallelDegrees
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import (
    MAX_OUTPUTS_PER_PROMPT,
    MAX_STEPS,
    InvalidRequestError,
    SamplingParams,
    filled,
)
from diffrt.engine.spec_support import (
    BANDED_VAES,
    WEIGHT_METHODS,
    CacheSupport,
    ParallelSupport,
    SamplingDefaults,
    check_heads,
)
from diffrt.engine.video_chunks import check_chunked, chunks_of

#: what a model can be asked to do: draw from text, redraw an input image
#: from a later step (``strength``), repaint a masked part of it, or edit it
#: (an editing model conditions on the image itself)
Task = Literal["text-to-image", "image-to-image", "inpainting", "editing"]
#: the tasks of a diffusers text-to-image folder (its img2img and inpaint
#: pipelines share its components)
TEXT_TO_IMAGE_TASKS: tuple[Task, ...] = ("text-to-image", "image-to-image", "inpainting")


class CfgRule(enum.Enum):
    """When classifier-free guidance runs for a request (two rows per output)."""

    #: ``guidance_scale`` > 1, as diffusers' StableDiffusion3Pipeline.
    GUIDANCE_GT_1 = "guidance_gt_1"
    #: ``true_cfg_scale`` > 1 and a negative prompt (the request's, else the
    #: model's default), as diffusers' FluxPipeline and QwenImagePipeline:
    #: there ``guidance_scale`` is an embedded input, not CFG.
    TRUE_CFG_AND_NEGATIVE = "true_cfg_and_negative"
    #: never (a model without an unconditional branch).
    NEVER = "never"


#: what two requests must agree on to share one fused forward: a request-level
#: forward runs one denoising loop, so the step count is in it
REQUEST_BATCH_FIELDS = ("height", "width", "num_inference_steps", "guidance_scale",
                        "true_cfg_scale", "num_outputs_per_prompt", "output_type", "strength",
                        "num_frames")
#: what two requests must agree on to share a denoise step: each keeps its own
#: noise scheduler (step counts may differ) and guidance is applied per row
STEP_BATCH_FIELDS = ("height", "width", "num_outputs_per_prompt", "output_type", "num_frames")
#: the step batch fields that may differ within a step where the pipeline runs
#: rows of different sizes together (``ModelSpec.mixed_sizes``): sizes, output
#: counts and output types (decodes are grouped by size and output type); the
#: rest of ``step_batch_fields`` (a plugin family's own) must match. LoRA
#: adapters are in no key: rows with any adapters share calls (``engine.lora``)
MIXED_FIELDS = ("height", "width", "num_outputs_per_prompt", "output_type", "num_frames")


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one model is and accepts; see the module docstring."""

    #: the name the engine serves it under (a registered name or the folder)
    name: str
    #: the diffrt family ("flux", "sd3", "qwen-image", or a plugin's)
    family: str
    #: "module:Class" of the worker-side pipeline that computes it
    pipeline: str
    #: the diffusers pipeline class its folder loads through (None: no folder)
    diffusers_pipeline: str | None = None
    #: the diffusers folder holding its weights (None: the pipeline builds them)
    folder: str | None = None
    tasks: tuple[Task, ...] = ("text-to-image",)
    #: input images one request may give (0: none; a text-to-image folder's
    #: image-to-image and inpainting take one)
    max_input_images: int = 0
    #: how an editing model sizes its input image (``input_size``):
    #: "preferred" — the trained resolution nearest its aspect ratio
    #: (``edit_resolutions``; FLUX.1 Kontext's ``_auto_resize``), "keep" — its
    #: own size rounded down to ``size_multiple``, "area" — ``edit_area``
    #: pixels at its aspect ratio in multiples of 32 (Qwen-Image-Edit's
    #: ``calculate_dimensions``; the output's default size too)
    #: "output" — the request's own size (an image-to-video model's first frame,
    #: as diffusers' video processor resizes it)
    edit_resize: Literal["preferred", "keep", "area", "output"] = "preferred"
    #: (width, height) resolutions an editing model was trained on
    edit_resolutions: tuple[tuple[int, int], ...] = ()
    edit_area: int = 1024 * 1024
    #: an editing model whose text encoder reads each input at another area
    #: than the VAE (Qwen-Image-Edit Plus: 384 x 384 px; None: the same copy)
    edit_prompt_area: int | None = None
    #: which input an edit's default output size follows ("area" models):
    #: the first (Qwen-Image-Edit) or the last (its Plus variant)
    edit_size_from: Literal["first", "last"] = "first"
    #: height and width must be positive multiples of this (VAE factor x patch)
    size_multiple: int = 16
    max_size: int = 2048
    #: a video model: its VAE's frames per latent frame (a clip has
    #: ``frame_factor`` x k + 1 frames) and the most frames a request may ask;
    #: 0 for an image model
    frame_factor: int = 0
    max_frames: int = 0
    #: a chunked video model (Helios, ``engine.video_chunks``): a chunk's latent
    #: frames, and the latent frames' worth of history tokens a call adds; else 0
    chunk_latent_frames: int = 0
    history_latent_frames: int = 0
    max_steps: int = MAX_STEPS
    defaults: SamplingDefaults
    #: the negative prompt of a request that names none (None: the request has
    #: none; under TRUE_CFG_AND_NEGATIVE that means no CFG, as in diffusers)
    default_negative_prompt: str | None = None
    cfg_rule: CfgRule = CfgRule.GUIDANCE_GT_1
    request_batch_fields: tuple[str, ...] = REQUEST_BATCH_FIELDS
    step_batch_fields: tuple[str, ...] = STEP_BATCH_FIELDS
    #: several whole requests fused into one forward (REQUEST_BATCH, max_num_seqs > 1)
    supports_request_batch: bool = False
    #: the step protocol (STEP_BATCH)
    supports_step_execution: bool = False
    #: STEP_BATCH: the pipeline runs rows of different image sizes in one step
    #: (one padded transformer call, or a call per size: ``pipelines.segments``),
    #: so requests of different sizes share a step (``mixed_step_batch_key``)
    mixed_sizes: bool = False
    parallel: ParallelSupport = ParallelSupport()
    #: module names (diffusers' ``target_modules``) a LoRA adapter may change;
    #: empty: the model takes no adapters
    lora_target_modules: tuple[str, ...] = ()
    #: lower-precision weight methods the family's pipeline applies
    #: (``EngineConfig.quantization``; ``engine.weights.quantize``); empty: none
    quantization: tuple[str, ...] = ()
    #: the most bytes one output pixel takes on its way to the host: 3 for
    #: uint8 RGB images, more for float32 latents of a VAE that downsamples
    #: little (what sizes the output arena, ``output_arena_bytes``)
    output_bytes_per_pixel: float = 3.0
    #: the transformer's attention width (heads x head dim) and the text tokens
    #: each row attends with: the shape of the run-time estimate
    #: (``engine.run_time``); 0: not known (the estimate is then linear in
    #: image tokens)
    transformer_width: int = 0
    text_tokens: int = 0
    #: the step caches it serves and their calibration
    cache: CacheSupport = CacheSupport()
    #: its denoise loop serves rollouts (``rollout_checks``, docs/rollouts.md)
    rollouts: bool = False
    #: how a finished output becomes what the request asked for
    #: (``engine.postprocess``): uint8 images -> PIL / tensor, latents as is
    postprocess: Literal["images"] = "images"
    #: a video model that makes a waveform beside its frames (LTX-2):
    #: ``DiffusionOutput.waveform``; output_type "latent" is refused (its
    #: audio latents have no field yet)
    sound: bool = False

    # -- defaults and checks (submission, the CLI, direct pipeline callers) ------------
    def with_defaults(self, request: DiffusionRequest) -> DiffusionRequest:
        """``request`` with the sampling fields it left at None taken from
        ``defaults`` (the same object when none was left)."""
        params = request.sampling_params
        defaults = msgspec.structs.asdict(self.defaults)
        if self.edit_resize == "area" and request.images and self.task_of(request) == "editing":
            # Qwen-Image-Edit draws at its input's size unless told otherwise
            sizer = request.images[0 if self.edit_size_from == "first" else -1]
            defaults["height"], defaults["width"] = self.input_shape(request, sizer)
        resolved = params.with_defaults(defaults)
        if params.strength is None and self.task_of(request) in ("image-to-image", "inpainting"):
            resolved = msgspec.structs.replace(resolved, strength=self.defaults.strength)
        if self.frame_factor and (params.num_frames is None or params.fps is None):
            resolved = msgspec.structs.replace(
                resolved, num_frames=params.num_frames or self.defaults.num_frames,
                fps=params.fps or self.defaults.fps)
        if self.chunk_latent_frames:
            chunks = chunks_of(filled(resolved.num_frames), self.chunk_latent_frames,
                               self.frame_factor)
            if resolved.chunks != chunks:
                resolved = msgspec.structs.replace(resolved, chunks=chunks)
        if resolved is params:
            return request
        return msgspec.structs.replace(request, sampling_params=resolved)

    def task_of(self, request: DiffusionRequest) -> Task:
        """What ``request`` asks of this model: its inputs' task, or an edit
        when this model edits the images it is given."""
        task: Task = request.task
        if task != "text-to-image" and "editing" in self.tasks:
            return "editing"
        return task

    def check(self, request: DiffusionRequest) -> None:
        """Raise InvalidRequestError naming the first field this model cannot
        run (on the request as it will run: defaults filled in)."""
        request = self.with_defaults(request)
        params = request.sampling_params
        task = self.task_of(request)
        if task not in self.tasks:
            field = "mask_image" if task == "inpainting" else "images"
            raise InvalidRequestError(field, f"{task} is not a task of {self.name} "
                                             f"(it serves {', '.join(self.tasks)})")
        if task == "editing" and request.mask_image is not None:
            raise InvalidRequestError("mask_image", f"{self.name} edits without a mask (an "
                                                    "edit with a mask is not served yet)")
        if len(request.images) > self.max_input_images:
            raise InvalidRequestError("images", (
                f"{self.name} takes at most {self.max_input_images} input image(s), "
                f"got {len(request.images)}"))
        if params.strength is not None and task not in ("image-to-image", "inpainting"):
            raise InvalidRequestError("strength", f"applies to image-to-image and inpainting, "
                                                  f"not to {task}")
        params.validate()
        for field in ("height", "width"):
            value = filled(getattr(params, field))
            if value > self.max_size or value % self.size_multiple:
                raise InvalidRequestError(field, (
                    f"must be a positive multiple of {self.size_multiple} no larger than "
                    f"{self.max_size} for {self.name}, got {value}"))
        self.check_frames(params)
        if self.sound and params.output_type == "latent":
            raise InvalidRequestError("output_type", (
                f"{self.name} makes sound beside its frames; 'latent' is not served for it "
                "yet (its audio latents have no field): use np, pt, pil or mp4"))
        if filled(params.num_inference_steps) > self.max_steps:
            raise InvalidRequestError("num_inference_steps", (
                f"must be at most {self.max_steps} for {self.name}, "
                f"got {params.num_inference_steps}"))
        if params.loras and not self.lora_target_modules:
            raise InvalidRequestError("loras", f"{self.name} takes no LoRA adapters")
        if params.cache not in (None, "off") and params.cache not in self.cache.policies:
            served = ", ".join(self.cache.policies) or "none"
            raise InvalidRequestError("cache", f"{self.name} serves no {params.cache!r} step "
                                               f"cache (it serves: {served})")
        if params.cache is None and params.cache_threshold is not None \
                and self.cache.default is None:
            raise InvalidRequestError("cache_threshold", (
                f"{self.name} has no default step cache: name a policy in cache"))

    def check_frames(self, params: SamplingParams) -> None:
        """A video model's clip is ``frame_factor`` x k + 1 frames, at most
        ``max_frames``; an image model takes neither field."""
        if not self.frame_factor:
            for field in ("num_frames", "fps"):
                if getattr(params, field) is not None:
                    raise InvalidRequestError(field, f"{self.name} draws images, not video")
            if params.output_type == "mp4":
                raise InvalidRequestError("output_type", f"{self.name} draws images, not video: "
                                                         "mp4 is a video model's")
            return
        frames, f = filled(params.num_frames), self.frame_factor
        if self.chunk_latent_frames:
            return check_chunked(params, self.chunk_latent_frames, self.frame_factor,
                                 self.max_frames, self.name)
        if params.chunks != 1:
            raise InvalidRequestError("chunks", f"{self.name} denoises a clip whole (1 chunk)")
        if frames % f != 1 % f or frames > self.max_frames:
            raise InvalidRequestError("num_frames", (
                f"must be {f}k + 1 (1, {f + 1}, {2 * f + 1}, ...) and at most {self.max_frames} "
                f"for {self.name}, got {frames}"))

    def latent_frames(self, params: SamplingParams) -> int:
        """Latent frames of a request's clip (1 for an image; a chunked
        model's: those one call attends, a chunk and its history)."""
        if self.chunk_latent_frames:
            return self.chunk_latent_frames + self.history_latent_frames
        if not self.frame_factor or params.num_frames is None:
            return 1
        return (params.num_frames - 1) // self.frame_factor + 1

    def output_frames(self, params: SamplingParams) -> int:
        """Frames of one output (1 for an image)."""
        return params.num_frames or 1 if self.frame_factor else 1

    def cache_plan(self, params: SamplingParams) -> CachePlan | None:
        """The step cache a request runs with (None: none): its policy, or
        the model's default; its threshold, or the model's calibrated one,
        or the policy's."""
        policy = self.cache.default if params.cache is None else params.cache
        if policy is None or policy == "off":
            return None
        threshold = params.cache_threshold
        if threshold is None:
            threshold = self.cache.thresholds.get(policy, DEFAULT_THRESHOLDS[policy])
        return CachePlan(policy, float(threshold),
                         self.cache.teacache_rescale if policy == TEACACHE else ())

    def input_size(self, request: DiffusionRequest, width: int, height: int) -> tuple[int, int]:
        """(height, width) an input image of ``width`` x ``height`` pixels is
        resized to: the request's size for image-to-image and inpainting (as
        diffusers' pipelines resize it); for an edit the model's own rule
        (``edit_resize``), as FluxKontextPipeline sizes it."""
        if self.task_of(request) != "editing" or self.edit_resize == "output":
            params = request.sampling_params
            return filled(params.height), filled(params.width)
        m = self.size_multiple
        if self.edit_resize == "area" and height and width:
            height, width = _area_size(self.edit_area, width, height)
        height, width = height - height % m, width - width % m  # get_default_height_width
        if self.edit_resize == "preferred" and self.edit_resolutions and height and width:
            aspect = width / height
            _, width, height = min((abs(aspect - w / h), w, h) for w, h in self.edit_resolutions)
        height, width = height // m * m, width // m * m
        if height < m or width < m:
            raise InvalidRequestError("images", f"{width}x{height} is smaller than "
                                                f"{m}x{m} pixels, the least {self.name} edits")
        return height, width

    def prompt_image_size(self, request: DiffusionRequest
                          ) -> Callable[[int, int], tuple[int, int]] | None:
        """The size rule of the copies of an edit's inputs its text encoder
        reads, where the model reads them at another size (``edit_prompt_area``)."""
        area = self.edit_prompt_area
        if area is None or self.task_of(request) != "editing":
            return None
        return lambda width, height: _area_size(area, width, height)

    def edit_tokens(self, request: DiffusionRequest) -> int:
        """The extra tokens an edit's input image adds to each row (0 for
        other tasks): its latent patches, as the output's are counted."""
        if self.task_of(request) != "editing" or self.edit_resize == "output":
            return 0  # "output": a first frame in the clip's place, no tokens of its own
        total = 0
        for image in request.images:
            h, w = self.input_shape(request, image)
            total += (h // self.size_multiple) * (w // self.size_multiple)
        return total

    def input_shape(self, request: DiffusionRequest, image: object) -> tuple[int, int]:
        """(height, width) of one of the request's inputs as it runs: a stored
        one's own (resized at submission), a given one's by ``input_size``."""
        from diffrt.engine.input_images import pixel_size, stored_shape

        stored = stored_shape(image)
        return stored if stored is not None else self.input_size(request, *pixel_size(image))

    # -- classifier-free guidance ------------------------------------------------------------
    def negative_prompt(self, request: DiffusionRequest) -> str | None:
        """The request's negative prompt, else the model's default."""
        if request.negative_prompt is not None:
            return request.negative_prompt
        return self.default_negative_prompt

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """Whether CFG runs for ``request`` (defaults filled in)."""
        params = request.sampling_params
        match self.cfg_rule:
            case CfgRule.GUIDANCE_GT_1:
                return filled(params.guidance_scale) > 1.0
            case CfgRule.TRUE_CFG_AND_NEGATIVE:
                return (filled(params.true_cfg_scale) > 1.0
                        and self.negative_prompt(request) is not None)
            case CfgRule.NEVER:
                return False

    # -- the work of a request (the run-time and memory estimates count it) -------------
    def rows(self, request: DiffusionRequest) -> int:
        """Transformer rows one denoise step of ``request`` runs: one per
        output, two with CFG (defaults filled in)."""
        return filled(request.sampling_params.num_outputs_per_prompt) * (
            2 if self.uses_cfg(request) else 1)

    def row_tokens(self, request: DiffusionRequest) -> int:
        """One row's tokens: the image's latent patches (a video's, every latent
        frame's) plus the model's text tokens (and an edit's input image's
        patches: ``edit_tokens``)."""
        params = request.sampling_params
        multiple = self.size_multiple
        patches = (filled(params.height) // multiple) * (filled(params.width) // multiple)
        return (patches * self.latent_frames(params) + self.text_tokens
                + self.edit_tokens(request))

    def cfg_scale(self, params: SamplingParams) -> float:
        """The scale of classifier-free guidance when it runs."""
        if self.cfg_rule is CfgRule.TRUE_CFG_AND_NEGATIVE:
            return float(filled(params.true_cfg_scale))
        return float(filled(params.guidance_scale))

    # -- batching ------------------------------------------------------------------------------
    def request_batch_key(self, request: DiffusionRequest) -> tuple:
        """What must match for two requests to share one fused forward."""
        params = request.sampling_params
        return (*(getattr(params, f) for f in self.request_batch_fields), self.uses_cfg(request),
                self.task_of(request))

    def step_batch_key(self, request: DiffusionRequest) -> tuple:
        """What must match for two requests to share a denoise step."""
        params = request.sampling_params
        return (*(getattr(params, f) for f in self.step_batch_fields), self.uses_cfg(request))

    def mixed_step_batch_key(self, request: DiffusionRequest) -> tuple:
        """What must match for two requests to share a denoise step when sizes
        may differ (``mixed_sizes``): ``step_batch_fields`` less
        ``MIXED_FIELDS``, and whether CFG runs (a call runs both branches for
        all its rows or for none)."""
        params = request.sampling_params
        return (*(getattr(params, f) for f in self.step_batch_fields if f not in MIXED_FIELDS),
                self.uses_cfg(request))

    # -- parallelism -----------------------------------------------------------------------------
    def check_parallel(self, degrees: ParallelDegrees, vae_parallel: bool = False) -> None:
        """Raise ``ParallelConfigError`` saying why this model cannot run split
        as ``degrees`` and ``vae_parallel`` say (before any worker starts)."""
        caps = self.parallel
        if not caps.multi_rank:
            if degrees.world_size > 1 or vae_parallel:
                raise ParallelConfigError("world_size",
                                          f"model {self.name!r} runs on one rank only")
            return
        if degrees.sequence_size > 1 and not caps.sequence:
            raise ParallelConfigError(
                "ulysses_degree" if degrees.ulysses > 1 else "ring_degree",
                f"{self.name}: its transformer has no sequence parallelism")
        check_heads(caps.attention_heads, degrees.ulysses)
        if vae_parallel and caps.vae_class not in BANDED_VAES:
            raise ParallelConfigError("vae_parallel", f"splits the decoder of an "
                                                      f"{' or '.join(BANDED_VAES)}; "
                                                      f"{self.name} has a {caps.vae_class}")

    def largest_output_bytes(self) -> int:
        """The bytes of the largest output one request may ask for."""
        return int(self.max_size * self.max_size * self.output_bytes_per_pixel
                   * MAX_OUTPUTS_PER_PROMPT * max(1, self.max_frames))

    # -- what the engine needs for its own warm-up ------------------------------------------------
    def warmup_size(self) -> int:
        """The side of a warm-up picture: about 64 px, within the model's limits."""
        multiple = self.size_multiple
        largest = self.max_size // multiple * multiple
        return max(multiple, min(multiple * -(-64 // multiple), largest))


def _area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(height, width) of ``area`` pixels at the aspect ratio of ``width`` x
    ``height``, in multiples of 32, as diffusers' Qwen-Image-Edit
    ``calculate_dimensions`` rounds them."""
    ratio = width / height
    exact = (area * ratio) ** 0.5
    return round(exact / ratio / 32) * 32, round(exact / 32) * 32


__all__ = ["BANDED_VAES", "REQUEST_BATCH_FIELDS", "STEP_BATCH_FIELDS", "TEXT_TO_IMAGE_TASKS",
           "WEIGHT_METHODS", "CacheSupport", "CfgRule", "ModelSpec", "ParallelSupport",
           "SamplingDefaults", "Task", "check_heads"]
