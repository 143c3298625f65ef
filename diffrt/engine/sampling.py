"""Sampling parameters, their validation and the batch-compatibility keys.

`SamplingParams` is a msgspec Struct so it crosses the process boundary as a
message field. The generic range checks live here; limits that depend on a
model (the size multiple, the largest size) are checked by the pipeline's
`check_inputs`, which calls `validate` with its own limits.
"""

from __future__ import annotations

import math
import random
from typing import Literal

import msgspec

OutputType = Literal["pil", "pt", "latent"]

MAX_STEPS = 1000
MAX_OUTPUTS_PER_PROMPT = 16
#: what ``torch.Generator.manual_seed`` accepts (and msgpack carries).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LORA_NAME_CHARS = 256
#: previews a step-mode request may ask for (as OpenAI's ``partial_images``).
MAX_PARTIAL_IMAGES = 3


def random_seed() -> int:
    """A fresh seed for a request that gave none: below 2**53, so it survives a
    JSON number in any client (JavaScript rounds larger integers) and can be
    sent back to reproduce the image."""
    return random.SystemRandom().randrange(2**53)


class InvalidRequestError(ValueError):
    """A request the user can fix: names the field and the allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


#: The fields a model may give defaults for (None in a request: the model's).
MODEL_DEFAULTED = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale")
#: what a model without a default of its own gives these fields
FALLBACK_DEFAULTS = {"true_cfg_scale": 1.0}


class SamplingParams(msgspec.Struct, kw_only=True):
    """What one request asks of the sampler.

    ``height``, ``width``, ``num_inference_steps``, ``guidance_scale`` and
    ``true_cfg_scale`` left at None take the model's defaults
    (``DiffusionPipeline.sampling_defaults``: for a diffusers folder, what its
    diffusers pipeline would use), filled in when the engine admits the
    request.
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    output_type: OutputType = "pil"
    lora_name: str | None = None
    #: seconds this request may take from submission to its final output; it
    #: can only lower the engine's ``request_timeout_s``. None: the engine's.
    timeout_s: float | None = None
    #: classifier-free guidance for families whose ``guidance_scale`` is an
    #: embedded input or unused (Flux, Qwen-Image): it runs when > 1 and a
    #: negative prompt is given or the model has a default one (diffrt-shapes:
    #: ""). None: the model's (diffrt-shapes 3.0, Qwen-Image 4.0, else 1.0).
    true_cfg_scale: float | None = None
    #: previews decoded from the current x0 prediction while the request runs
    #: (step mode only): preview k of N after step ceil(k * T / (N + 1)).
    partial_images: int = 0

    def preview_steps(self) -> list[int]:
        """The step counts after which a preview is decoded, in order: distinct
        and before the last step (the final image comes then)."""
        n, total = self.partial_images, self.num_inference_steps
        steps = sorted({-(-k * total // (n + 1)) for k in range(1, n + 1)})
        return [s for s in steps if 0 < s < total]

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """A copy with each of ``MODEL_DEFAULTED`` that is None taken from
        ``defaults`` (self when nothing is missing)."""
        merged = {**FALLBACK_DEFAULTS, **defaults}
        missing = {f: merged[f] for f in MODEL_DEFAULTED
                   if getattr(self, f) is None and f in merged}
        return msgspec.structs.replace(self, **missing) if missing else self

    def validate(self, *, size_multiple: int = 16, max_size: int = 4096) -> None:
        """Raise InvalidRequestError naming the first bad field and its range
        (after ``with_defaults``: a None left here is refused)."""
        for field in ("height", "width"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(field, f"must be an int, got {value!r}")
            if value <= 0 or value > max_size or value % size_multiple:
                raise InvalidRequestError(
                    field,
                    f"must be a positive multiple of {size_multiple} no larger than "
                    f"{max_size}, got {value}",
                )
        steps = self.num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise InvalidRequestError(
                "num_inference_steps", f"must be an int in [1, {MAX_STEPS}], got {steps!r}"
            )
        for name in ("guidance_scale", "true_cfg_scale"):
            g = getattr(self, name)
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                    or g < 0:
                raise InvalidRequestError(name, f"must be a finite number >= 0, got {g!r}")
        n = self.num_outputs_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_OUTPUTS_PER_PROMPT:
            raise InvalidRequestError(
                "num_outputs_per_prompt",
                f"must be an int in [1, {MAX_OUTPUTS_PER_PROMPT}], got {n!r}",
            )
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not SEED_MIN <= seed <= SEED_MAX):
            raise InvalidRequestError(
                "seed", f"must be None or an int in [{SEED_MIN}, {SEED_MAX}], got {seed!r}")
        if self.output_type not in ("pil", "pt", "latent"):
            raise InvalidRequestError(
                "output_type", f"must be one of 'pil', 'pt', 'latent', got {self.output_type!r}"
            )
        lora = self.lora_name
        if lora is not None and (not isinstance(lora, str) or len(lora) > MAX_LORA_NAME_CHARS):
            raise InvalidRequestError(
                "lora_name", f"must be None or a str of at most {MAX_LORA_NAME_CHARS} characters")
        p = self.partial_images
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= MAX_PARTIAL_IMAGES:
            raise InvalidRequestError(
                "partial_images", f"must be an int in [0, {MAX_PARTIAL_IMAGES}], got {p!r}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or t <= 0):
            raise InvalidRequestError("timeout_s", f"must be None or a number > 0, got {t!r}")

    @property
    def megapixel_steps(self) -> float:
        """pixels x steps x outputs / 10^6: the transformer work without CFG
        (the pipeline knows whether CFG runs, which doubles it)."""
        pixels = self.height * self.width * self.num_inference_steps * self.num_outputs_per_prompt
        return pixels / 1e6

    def request_batch_key(self) -> tuple:
        """Parameter fields that must match for two requests to share one fused
        forward (the pipeline adds whether CFG runs, see
        ``DiffusionPipeline.request_batch_key``).

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
            self.lora_name,
        )

    def step_batch_key(self) -> tuple:
        """Parameter fields that must match for two requests to share a denoise
        step (the pipeline adds whether CFG runs).

        Step counts may differ: each request keeps its own scheduler state.
        Guidance scales may differ too (they are applied per row).
        """
        return (
            self.height,
            self.width,
            self.num_outputs_per_prompt,
            self.output_type,
            self.lora_name,
        )
