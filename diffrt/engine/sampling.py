"""Sampling parameters, their validation and the batch-compatibility keys.

`SamplingParams` is a msgspec Struct so it crosses the process boundary as a
message field. The generic range checks live here; limits that depend on a
model (the size multiple, the largest size) are its ``ModelSpec``'s.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from diffrt.engine.declarations import DeclaredExtra
from diffrt.field_error import FieldError
from diffrt.runtime.types import DeclaredValueError, check_declared

OutputType = Literal["pil", "np", "pt", "latent", "mp4"]
#: what a request may ask of the step cache (``engine.cache``): "off", or a
#: policy that reuses the transformer's work between denoise steps
CachePolicyName = Literal["off", "first-block", "teacache"]
#: the largest cache threshold a request may give (the metrics compared
#: with it are relative differences: beyond a few every step is reused)
MAX_CACHE_THRESHOLD = 100.0

MAX_STEPS = 1000
MAX_OUTPUTS_PER_PROMPT = 16
#: the most frames and the highest frame rate a video request may ask for (a
#: model's own bound, ``ModelSpec.max_frames``, may be lower)
MAX_FRAMES = 1025
MAX_FPS = 240.0
#: what ``torch.Generator.manual_seed`` accepts (and msgpack carries).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LORA_NAME_CHARS = 256
#: the adapters one request may name (``max_loras`` may bound it lower) and
#: the largest scale (either sign) it may give one
MAX_LORAS_PER_REQUEST = 16
MAX_LORA_SCALE = 100.0
#: previews a request may ask for in step-batch execution (as OpenAI's ``partial_images``).
MAX_PARTIAL_IMAGES = 3
#: the priorities a request may give (lower runs first, vLLM's convention)
MIN_PRIORITY, MAX_PRIORITY = -10, 10
#: how a request's latents are stepped: "default" — the model's own noise
#: scheduler (an ODE for the flow-matching families); "flow-sde" — Flow-GRPO's
#: SDE step, which draws fresh noise each step and so has a log-prob
#: (``pipelines/flow_sde.py``, docs/rollouts.md)
SamplerName = Literal["default", "flow-sde"]
#: Flow-GRPO's default noise level (its ``noise_level``, the paper's a)
DEFAULT_NOISE_LEVEL = 0.7
MAX_NOISE_LEVEL = 10.0


def random_seed() -> int:
    """A fresh seed for a request that gave none: below 2**53, so it survives a
    JSON number in any client (JavaScript rounds larger integers) and can be
    sent back to reproduce the image."""
    return random.SystemRandom().randrange(2**53)


_T = TypeVar("_T")


def filled(value: _T | None) -> _T:
    """A model-defaulted field (``MODEL_DEFAULTED``) of a request the engine
    accepted: its defaults were filled in at submission, so never None."""
    assert value is not None, "read before the model's defaults were filled in"
    return value


class InvalidRequestError(FieldError):
    """A request the user can fix: names the field and the allowed range."""


#: The fields a model may give defaults for (None in a request: the model's).
MODEL_DEFAULTED = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale")
#: the largest guidance scale (either kind) a request may ask for
MAX_GUIDANCE = 1000.0
INT64_MAX = 2**63 - 1


def _about(description: str, *, http: str | None = "", cli: tuple[str, ...] | None = (),
           unchecked_le: int | None = None, needs_image: bool = False, **limits: Any) -> Meta:
    """A sampling field's declaration beside its type (``Annotated[type, _about(...)]``):
    its help, ``limits`` (msgspec ``Meta``: the check and the error naming the
    field; on an optional field they sit on the inner type instead), and how the
    other surfaces spell it: ``http`` is the HTTP body's name ("" the same
    name, None: no meaning over HTTP, the declaration says why), ``cli`` the
    command line's extra aliases (None: no flag). ``unchecked_le`` is an upper
    bound beyond msgspec's int64 ones, kept here and checked by ``validate``.
    ``needs_image``: the field means something only for a request with input
    images (the HTTP body of /v1/images/edits carries it, that of
    /v1/images/generations does not). The HTTP body (``serve/protocol.py``) and the CLI flags
    (``cli/engine_opts.py``) are built from these."""
    extra: DeclaredExtra = {"http": http, "cli": None if cli is None else list(cli),
                             "needs_image": needs_image}
    if unchecked_le is not None:
        extra["le"] = unchecked_le
    return Meta(description=description, extra=dict(extra), **limits)


class SamplingParams(msgspec.Struct, kw_only=True):
    """What one request asks of the sampler; every field declared once.

    ``height``, ``width``, ``num_inference_steps``, ``guidance_scale`` and
    ``true_cfg_scale`` left at None take the model's defaults
    (``ModelSpec.defaults``: for a diffusers folder, what its diffusers
    pipeline would use), filled in when the engine accepts the request.
    """

    height: Annotated[Annotated[int, Meta(ge=1)] | None, _about(
        "pixels (default: the model's)", http="size")] = None
    width: Annotated[Annotated[int, Meta(ge=1)] | None, _about(
        "pixels (default: the model's)", http="size")] = None
    num_inference_steps: Annotated[Annotated[int, Meta(ge=1, le=MAX_STEPS)] | None, _about(
        "denoising steps (default: the model's)", cli=("--steps",))] = None
    guidance_scale: Annotated[Annotated[float, Meta(ge=0, le=MAX_GUIDANCE)] | None, _about(
        "SD3: classifier-free guidance runs when > 1; Flux: the embedded guidance of "
        "guidance-distilled checkpoints (default: the model's)")] = None
    seed: Annotated[Annotated[int, Meta(ge=SEED_MIN)] | None, _about(
        "the request's noise seed; None: a fresh one, returned with the output",
        unchecked_le=SEED_MAX)] = None
    num_outputs_per_prompt: Annotated[int, _about(
        "images for the prompt", http="n", cli=("-n", "--num-images"),
        ge=1, le=MAX_OUTPUTS_PER_PROMPT)] = 1
    output_type: Annotated[OutputType, _about(
        "pil, np (uint8 array), pt (uint8 tensor), latent, or mp4 (a video model: each "
        "output's H.264 MP4 bytes in output, its frames beside them); over HTTP the response_format and "
        "output_format say what comes back instead", http=None, cli=None)] = "pil"
    loras: Annotated[Annotated[dict[Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME_CHARS)],
                                    Annotated[float, Meta(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)]],
                               Meta(max_length=MAX_LORAS_PER_REQUEST)] | None, _about(
        "LoRA adapters by registered name and their scales, composed as diffusers' "
        "set_adapters(names, adapter_weights) composes them (at most max_loras)",
        cli=("--lora",))] = None
    #: seconds this request may take from submission to its final output; it
    #: can only lower the engine's ``request_timeout_s``. None: the engine's.
    timeout_s: Annotated[Annotated[float, Meta(gt=0, le=1e9)] | None, _about(
        "seconds from submission to the final output; only lowers the engine's "
        "request_timeout_s", http="timeout_ms")] = None
    #: classifier-free guidance for families whose ``guidance_scale`` is an
    #: embedded input or unused (Flux, Qwen-Image): it runs when > 1 and a
    #: negative prompt is given or the model has a default one (diffrt-shapes:
    #: ""). None: the model's (diffrt-shapes 3.0, Qwen-Image 4.0, else 1.0).
    true_cfg_scale: Annotated[Annotated[float, Meta(ge=0, le=MAX_GUIDANCE)] | None, _about(
        "Flux, Qwen-Image: true classifier-free guidance, runs when > 1 with a negative "
        "prompt or the model's default one (default: the model's)")] = None
    #: previews decoded from the current x0 prediction while the request runs
    #: (STEP_BATCH only): preview k of N after step ceil(k * T / (N + 1)).
    partial_images: Annotated[int, _about(
        "previews streamed before the final image (STEP_BATCH; over HTTP with stream=true; "
        "the CLI writes final images only)", cli=None, ge=0, le=MAX_PARTIAL_IMAGES)] = 0
    #: image-to-image and inpainting: the share of the denoising schedule run
    #: from the input image, as diffusers' ``strength`` (1.0: from pure
    #: noise; the steps that run are ``denoise_steps``). Only with an input
    #: image; None then takes the model's default (diffusers' 0.6).
    strength: Annotated[Annotated[float, Meta(gt=0, le=1)] | None, _about(
        "image-to-image and inpainting: how much of the input image is re-drawn, in "
        "(0, 1]; the steps that run are int(steps * strength) as diffusers rounds them "
        "(only with an input image; default: the model's)", needs_image=True)] = None

    #: reuse of the transformer's work between steps (``engine.cache``):
    #: "first-block" (First-Block Cache) or "teacache" (TeaCache), decided
    #: per request and step; "off" never; None: the model's default (off
    #: unless its spec carries a calibrated one).
    cache: Annotated[CachePolicyName | None, _about(
        "step cache: first-block, teacache or off; reuses the transformer's remaining "
        "blocks on steps whose input changed less than cache_threshold (default: the "
        "model's, off unless it has a calibrated one)")] = None
    #: the policy's threshold (None: the policy's default, or the model's
    #: calibrated one); 0 reuses nothing.
    cache_threshold: Annotated[Annotated[float, Meta(ge=0, le=MAX_CACHE_THRESHOLD)] | None, _about(
        "the step cache's threshold: higher reuses more steps (default: the policy's "
        "for this model; 0 reuses none)")] = None

    #: a video model's clip: frames of the form the VAE needs (Wan: 4k + 1)
    #: and the frame rate it is meant to play at; None: the model's. An image
    #: model refuses them (``ModelSpec.check``).
    num_frames: Annotated[Annotated[int, Meta(ge=1, le=MAX_FRAMES)] | None, _about(
        "video models: frames of the clip, of the form the model's VAE needs (Wan: 4k + 1; "
        "default: the model's; over HTTP: /v1/videos' seconds or num_frames); given without "
        "a model, diffrt generate runs the default video model (diffrt-motion)",
        http=None)] = None
    fps: Annotated[Annotated[float, Meta(gt=0, le=MAX_FPS)] | None, _about(
        "video models: the clip's frames per second (default: the model's)", http=None)] = None
    #: a chunked video model's (Helios): the latent chunks the clip is
    #: denoised in, one after another, each over ``num_inference_steps`` steps;
    #: the model sets it from ``num_frames`` when it accepts the request
    #: (``ModelSpec.with_defaults``), every other model leaves it at 1
    chunks: Annotated[int, _about(
        "chunked video models (Helios): the chunks the clip is denoised in, set by the model "
        "from num_frames", http=None, cli=None, ge=1, le=MAX_FRAMES)] = 1

    #: the scheduling class (``scheduling_policy="slo"`` orders by it first;
    #: the other policies ignore it); lower runs first
    priority: Annotated[int, _about(
        f"scheduling priority, {MIN_PRIORITY}..{MAX_PRIORITY}, lower runs first (with "
        "scheduling_policy slo; a server may refuse values below its "
        "--client-priority-floor)", ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    #: a latency target in seconds from arrival: what ``slo`` schedules by
    #: (least slack first) and what the deadline counters judge; it never
    #: ends a request (``timeout_s`` does). None: no target.
    deadline_s: Annotated[Annotated[float, Meta(gt=0, le=1e9)] | None, _about(
        "latency target in seconds from arrival, a scheduling target only (slo orders by "
        "slack; it never ends the request: timeout_s does)", http="deadline_ms")] = None

    #: rollouts for reinforcement learning (docs/rollouts.md): the sampler,
    #: its noise level, and what comes back beside the images
    sampler: Annotated[SamplerName, _about(
        "default (the model's noise scheduler) or flow-sde (Flow-GRPO's SDE step: fresh "
        "noise each step, a log-prob per step; flow-matching families)")] = "default"
    noise_level: Annotated[Annotated[float, Meta(gt=0, le=MAX_NOISE_LEVEL)] | None, _about(
        f"flow-sde's noise level (Flow-GRPO's a; default {DEFAULT_NOISE_LEVEL})")] = None
    return_log_probs: Annotated[bool, _about(
        "flow-sde: each step's transition log-prob per output, (n, steps) float32 in "
        "DiffusionOutput.rollout (over HTTP: a safetensors download, diffrt.rollout)",
        cli=None)] = False
    return_trajectory: Annotated[bool, _about(
        "the latents before and after each step, (n, steps + 1, C, h, w), with the "
        "timesteps and sigmas, in DiffusionOutput.rollout (over HTTP: a safetensors "
        "download, diffrt.rollout)", cli=None)] = False
    #: each output's own seed (``n`` of them): output i draws its noise (the
    #: first latents, and flow-sde's at each step) from its own generator,
    #: so a request with ``seeds=[s]`` reproduces it alone
    seeds: Annotated[Annotated[list[Annotated[int, Meta(ge=SEED_MIN)]],
                               Meta(min_length=1, max_length=MAX_OUTPUTS_PER_PROMPT)] | None,
                     _about("one seed per output (as many as n): each output's noise is drawn "
                            "from its own, so seeds=[s] alone reproduces that output; instead "
                            "of seed", cli=None)] = None

    #: batch invariance: its text encoding, each denoise step's transformer
    #: call and its decode run on its rows alone, so its images (and
    #: log-probs) are bit-identical whatever it is batched with
    deterministic: Annotated[bool, _about(
        "bit-identical images and log-probs whatever the request is batched with: its "
        "rows get transformer calls (and text encoding, decode) of their own, at the cost "
        "of the batching they would share (docs/rollouts.md)")] = False

    def start_step(self) -> int:
        """The schedule step an image-to-image request starts at, as
        diffusers' ``get_timesteps`` computes it (0 without ``strength``)."""
        steps = filled(self.num_inference_steps)
        if self.strength is None:
            return 0
        init = min(steps * self.strength, steps)
        return int(max(steps - init, 0))

    def denoise_steps(self) -> int:
        """The denoise steps this request runs: the schedule's steps from
        ``start_step`` on (all of them for text-to-image), once per chunk of
        a chunked video model's clip (``chunks``)."""
        return (filled(self.num_inference_steps) - self.start_step()) * self.chunks

    def preview_steps(self) -> list[int]:
        """The step counts after which a preview is decoded, in order: distinct
        and before the last step (the final image comes then). A chunked
        clip's are its chunks' ends but the last: each finished chunk's
        frames are its previews (``partial_images`` does not apply)."""
        if self.chunks > 1:
            per = self.denoise_steps() // self.chunks
            return [k * per for k in range(1, self.chunks)]
        n, total = self.partial_images, self.denoise_steps()
        steps = sorted({-(-k * total // (n + 1)) for k in range(1, n + 1)})
        return [s for s in steps if 0 < s < total]

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """A copy with each of ``MODEL_DEFAULTED`` that is None taken from
        ``defaults`` (self when nothing is missing)."""
        missing = {f: defaults[f] for f in MODEL_DEFAULTED
                   if getattr(self, f) is None and f in defaults}
        return msgspec.structs.replace(self, **missing) if missing else self

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that breaks its
        declaration (after ``with_defaults``: a model-defaulted None left here
        is refused). The model's own limits (size multiple, largest size) are
        its spec's (``ModelSpec.check``)."""
        for name in MODEL_DEFAULTED:
            if getattr(self, name) is None:
                raise InvalidRequestError(name, "must be set (the model's default fills it in)")
        try:
            check_declared(self)
        except DeclaredValueError as exc:
            raise InvalidRequestError(exc.field, exc.reason) from None
        if self.seed is not None and self.seed > SEED_MAX:  # beyond msgspec's int64 bounds
            raise InvalidRequestError("seed", f"must be <= {SEED_MAX}, got {self.seed}")
        for name, scale in (self.loras or {}).items():
            if not math.isfinite(scale):
                raise InvalidRequestError("loras", f"{name}: scale must be finite, got {scale}")
        if (self.deadline_s is not None and self.timeout_s is not None
                and self.deadline_s > self.timeout_s):
            raise InvalidRequestError("deadline_s", (
                f"{self.deadline_s:g} s is past the request's timeout_s ({self.timeout_s:g} s), "
                "which would end it first"))
        if self.cache_threshold is not None and self.cache == "off":
            raise InvalidRequestError("cache_threshold", 'applies to a step cache, not to cache="off"')
        self._validate_rollout()
        if self.strength is not None and self.denoise_steps() < 1:
            raise InvalidRequestError("strength", (
                f"{self.strength:g} of {self.num_inference_steps} steps leaves no step to run "
                "(diffusers runs int(steps * strength)); raise strength or num_inference_steps"))

    def _validate_rollout(self) -> None:
        """The rollout fields' rules among themselves (the model's support:
        ``ModelSpec.check``)."""
        if self.noise_level is not None and self.sampler != "flow-sde":
            raise InvalidRequestError("noise_level", 'applies to sampler="flow-sde"')
        if self.return_log_probs and self.sampler != "flow-sde":
            raise InvalidRequestError("return_log_probs", (
                'needs sampler="flow-sde" (the default sampler\'s steps are deterministic: '
                "they have no log-prob)"))
        if self.seeds is None:
            return
        if len(self.seeds) != self.num_outputs_per_prompt:
            raise InvalidRequestError("seeds", (
                f"gives {len(self.seeds)} seed(s) for {self.num_outputs_per_prompt} output(s) "
                "(num_outputs_per_prompt): one per output"))
        if self.seed is not None:
            raise InvalidRequestError("seeds", "gives each output's seed: leave seed unset")
        for seed in self.seeds:
            if seed > SEED_MAX:
                raise InvalidRequestError("seeds", f"each must be <= {SEED_MAX}, got {seed}")

    @property
    def effective_noise_level(self) -> float:
        """flow-sde's noise level (the default when the request gave none)."""
        return DEFAULT_NOISE_LEVEL if self.noise_level is None else self.noise_level

    @property
    def keeps_row_noise(self) -> bool:
        """Its outputs keep noise state between steps (flow-sde's draws, their
        own seeds) or record them (log-probs, a trajectory): a fused
        REQUEST_BATCH forward runs it through the step protocol."""
        return (self.sampler != "default" or self.return_log_probs or self.return_trajectory
                or self.seeds is not None)

    def request_batch_key(self) -> tuple:
        """Parameter fields that must match for two requests to share one fused
        forward, for a scheduler used without a model (``ModelSpec.request_batch_key``
        adds whether CFG runs).

        Step count is part of the key: a request-level forward runs one loop.
        """
        return (
            self.height,
            self.width,
            self.num_inference_steps,
            self.guidance_scale,
            self.true_cfg_scale,
            self.num_outputs_per_prompt,
            self.output_type,
            self.strength,
            self.num_frames,
        )

    def step_batch_key(self) -> tuple:
        """Parameter fields that must match for two requests to share a denoise
        step, for a scheduler used without a model (``ModelSpec.step_batch_key``
        adds whether CFG runs).

        Step counts may differ: each request keeps its own scheduler state.
        Guidance scales may differ too (they are applied per row).
        """
        return (
            self.height,
            self.width,
            self.num_outputs_per_prompt,
            self.output_type,
            self.num_frames,
        )
