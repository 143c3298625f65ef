"""Sampling parameters, their validation and the batch-compatibility keys.

`SamplingParams` is a msgspec Struct so it crosses the process boundary as a
message field. The generic range checks live here; limits that depend on a
model (the size multiple, the largest size) are checked by the pipeline's
`check_inputs`, which calls `validate` with its own limits.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

OutputType = Literal["pil", "pt", "latent"]

MAX_STEPS = 1000
MAX_OUTPUTS_PER_PROMPT = 16


class InvalidRequestError(ValueError):
    """A request the user can fix: names the field and the allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, kw_only=True):
    """What one request asks of the sampler."""

    height: int = 128
    width: int = 128
    num_inference_steps: int = 4
    guidance_scale: float = 1.0
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    output_type: OutputType = "pil"
    lora_name: str | None = None

    def validate(self, *, size_multiple: int = 16, max_size: int = 4096) -> None:
        """Raise InvalidRequestError naming the first bad field."""
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
        gs = self.guidance_scale
        if isinstance(gs, bool) or not isinstance(gs, (int, float)) or not math.isfinite(gs):
            raise InvalidRequestError("guidance_scale", f"must be a finite number, got {gs!r}")
        if gs < 0:
            raise InvalidRequestError("guidance_scale", f"must be >= 0, got {gs!r}")
        n = self.num_outputs_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_OUTPUTS_PER_PROMPT:
            raise InvalidRequestError(
                "num_outputs_per_prompt",
                f"must be an int in [1, {MAX_OUTPUTS_PER_PROMPT}], got {n!r}",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError("seed", f"must be an int or None, got {self.seed!r}")
        if self.output_type not in ("pil", "pt", "latent"):
            raise InvalidRequestError(
                "output_type", f"must be one of 'pil', 'pt', 'latent', got {self.output_type!r}"
            )

    @property
    def do_cfg(self) -> bool:
        """Classifier-free guidance runs when the scale exceeds one."""
        return self.guidance_scale > 1.0

    def request_batch_key(self) -> tuple:
        """Fields that must match for two requests to share one fused forward.

        Step count is part of the key: a request-level forward runs one loop.
        """
        return (
            self.height,
            self.width,
            self.num_inference_steps,
            self.do_cfg,
            self.guidance_scale,
            self.num_outputs_per_prompt,
            self.output_type,
            self.lora_name,
        )

    def step_batch_key(self) -> tuple:
        """Fields that must match for two requests to share a denoise step.

        Step counts may differ: each request keeps its own scheduler state.
        Guidance scale may differ too (it is applied per request), but whether
        CFG runs at all changes the batch layout, so `do_cfg` is in the key.
        """
        return (
            self.height,
            self.width,
            self.do_cfg,
            self.num_outputs_per_prompt,
            self.output_type,
            self.lora_name,
        )
