"""What the engine hands back for a request: progress and final outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL.Image import Image


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (None when a phase did not happen), and
    what its text encoders cut from its prompts."""

    arrival_time: float = 0.0
    queue_wait: float | None = None
    forward_time: float | None = None
    output_wait: float | None = None
    postprocess_time: float | None = None
    finished_time: float | None = None
    #: text encoder (the folder's component name) -> the tokens of the prompt
    #: and negative prompt (together) it cut, for the encoders that cut any:
    #: a prompt longer than an encoder's window is cut there, as in diffusers
    #: (CLIP's window is 77 tokens, Flux's T5 512, SD3's T5 256)
    prompt_tokens_dropped: dict[str, int] = field(default_factory=dict)
    #: what its step cache did (None: the request ran without one)
    cache: CacheMetrics | None = None
    #: its scheduling priority and latency target (``SamplingParams``), and
    #: whether it finished within that target: None without one or when it
    #: was aborted, False when it failed or timed out
    priority: int = 0
    deadline_s: float | None = None
    deadline_met: bool | None = None
    #: how often it was paused for a more urgent request (``slo``)
    preemptions: int = 0


@dataclass
class Rollout:
    """What a request recorded of its steps, for a trainer (docs/rollouts.md):
    host tensors, owned by the caller. Step k of T took ``latents[:, k]`` to
    ``latents[:, k + 1]`` at ``timesteps[k]`` (schedule sigmas ``sigmas[k]``
    -> ``sigmas[k + 1]``); the last latents decode to the returned images."""

    #: (T,) the steps' timesteps and (T + 1,) their sigmas, float32
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    #: (n, T) float32: each step's transition log-prob per output (flow-sde,
    #: ``return_log_probs``; the per-element mean, as Flow-GRPO's); else None
    log_probs: torch.Tensor | None = None
    #: (n, T + 1, C, h, w) in the model's dtype, the VAE's latent layout
    #: (``return_trajectory``); else None
    latents: torch.Tensor | None = None

    @property
    def latents_before(self) -> torch.Tensor | None:
        """(n, T, ...): the latents each step started from."""
        return None if self.latents is None else self.latents[:, :-1]

    @property
    def latents_after(self) -> torch.Tensor | None:
        """(n, T, ...): the latents each step gave."""
        return None if self.latents is None else self.latents[:, 1:]


@dataclass
class DiffusionOutput:
    """One item of a request's output stream.

    Progress items have `finished=False` and carry `step`/`total_steps` (and,
    at preview steps, `preview`); the final item has `finished=True` and either
    `images`/`output` or `error`.
    """

    request_id: str
    finished: bool = False
    error: str | None = None
    aborted: bool = False
    step: int = 0
    total_steps: int = 0
    images: list[Image] | None = None  # PIL images for output_type "pil"
    #: a torch tensor for output_type "pt" / "latent", a uint8 array for
    #: "np", each output's MP4 bytes for "mp4"
    output: torch.Tensor | np.ndarray | list[bytes] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    #: the seed the request ran with (a random one when it gave none), so any
    #: image can be reproduced by submitting it again with this seed.
    seed: int | None = None
    #: a progress item carrying a preview (``partial_images``): the images as
    #: predicted at this step (PIL for output_type "pil", else a host tensor)
    #: and the preview's index, 0-based.
    preview: list[Image] | list[list[Image]] | torch.Tensor | np.ndarray | None = None
    preview_index: int | None = None
    #: a limit ended it (request_timeout_s, its own timeout_s, or its output
    #: left unread past unread_output_timeout_s); ``error`` names the limit.
    timed_out: bool = False
    #: a video's final item (``num_frames``): each output's frames (PIL for
    #: output_type "pil"; else ``output`` holds them, (N, F, H, W, 3)) and
    #: the frame rate they play at
    frames: list[list[Image]] | None = None
    fps: float | None = None
    #: a video with sound (LTX-2): each output's waveform, (N, channels,
    #: samples) float32 in [-1, 1], and the samples a second it plays at
    #: (with output_type "mp4" it is also muxed into each file as AAC)
    waveform: np.ndarray | None = None
    sample_rate: int | None = None
    #: what it recorded of its steps when it asked (``return_log_probs``,
    #: ``return_trajectory``), through shared memory like the images
    rollout: Rollout | None = None
    #: each output's seed when the request gave ``seeds``
    seeds: list[int] | None = None
    #: the transformer weights' version it ran on (``update_weights``), and
    #: its LoRA adapters' versions by name (``update_lora``)
    weights_version: int | str = 0
    lora_versions: dict[str, int | str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None and not self.aborted


def split_rollout(value: Any) -> tuple[Any, Rollout | None]:
    """A worker's output as it arrived: (its images, its ``Rollout`` when it
    carries one beside them)."""
    if isinstance(value, dict) and "rollout" in value:
        return value["images"], Rollout(**value["rollout"])
    return value, None


class CacheMetrics(msgspec.Struct, frozen=True):
    """What one request's step cache did (``engine.cache``)."""

    #: "first-block" or "teacache"
    policy: str
    threshold: float
    #: denoise steps that ran the cached blocks, and steps that reused them
    steps_computed: int = 0
    steps_reused: int = 0
    #: the 0-based denoise steps that reused (its decisions, in order)
    reused_steps: list[int] = []
    #: why it ran uncached although it asked for a cache (None: it did not):
    #: "cache_state_bytes" — its state would not fit the worker's bound
    uncached_reason: str | None = None


class TextEncoderStats(msgspec.Struct, frozen=True):
    """Cumulative text-encoding counters of one worker (replies carry deltas)."""

    #: prompts run through the text encoder (cache misses).
    encoded: int = 0
    #: prompts answered from the cache.
    cache_hits: int = 0
    #: seconds spent in the text encoder.
    seconds: float = 0.0

    def __sub__(self, other: TextEncoderStats) -> TextEncoderStats:
        return TextEncoderStats(self.encoded - other.encoded, self.cache_hits - other.cache_hits,
                                self.seconds - other.seconds)

    def __add__(self, other: TextEncoderStats) -> TextEncoderStats:
        return TextEncoderStats(self.encoded + other.encoded, self.cache_hits + other.cache_hits,
                                self.seconds + other.seconds)
