"""The family contract: what the denoise loop and its stages ask of a
flow-matching pipeline (``flow_match.FlowMatchPipeline`` and the families
that subclass it).

A family supplies five things and nothing else — its spec (``load`` sets
it), its encoders (``encode_with_diffusers``, ``prompt_windows``; an editor
whose text encoder reads images: ``encode_with_images``), its transformer
call (``transformer_forward`` over rows of one size; where rows of several
sizes share a call, ``padded_forward`` and, if it packs them,
``packed_forward``; ``transformer_blocks`` where step caches cut it at its
blocks; ``sequence_hooks`` where its tokens split over ranks — each entry
the layer of that name in ``transformer_call`` calls), its latent layout (``latents``, a
``latents.LatentLayout``; ``timestep_kwargs``: the sigmas that layout's
token count shifts) and its decode (``decode_latents``; for input images
``encode_image_dist`` / ``normalize_image_latents``). ``FlowMatchHost`` is
that contract as the loop's modules (``conditioning``, ``denoise``,
``transformer_call``) see it, so they import no pipeline class; docs/families.md
shows it on one page.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch

from diffrt.engine.cache.forward import TransformerBlocks
from diffrt.engine.cache.state import CacheBudget, RequestCache
from diffrt.engine.input_images import InputPixels
from diffrt.engine.lora.row_lora import RowLoras
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.interface import RequestOutput, StepRequestState
from diffrt.engine.pipelines.latents import SpatialLatents
from diffrt.engine.pipelines.prompt_cache import TextEncoder
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.weights.offload import LayerwiseOffload

if TYPE_CHECKING:
    import torch.distributed as dist
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, SchedulerMixin
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution


class SequenceHost(Protocol):
    """What the sequence-split layer installs on (``transformer_call.SequenceShard``)."""

    #: the sequence-parallel split of each call (None: the call runs whole)
    sequence_split: SequenceSplit | None

    def sequence_hooks(self, split: SequenceSplit) -> None: ...


class OffloadHost(Protocol):
    """What the offload layer installs on (``transformer_call.BlockOffload``)."""

    offload: LayerwiseOffload | None

    @property
    def eager_transformer(self) -> torch.nn.Module: ...

    def offload_blocks(self) -> list[torch.nn.Module]: ...


class FlowMatchHost(Protocol):
    """A flow-matching pipeline as its loop's stages use it (see the module)."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    latents: SpatialLatents
    vae: AutoencoderKL | AutoencoderKLQwenImage
    text_encoder: TextEncoder
    #: the family's text encoder reads an edit's input images with its prompt
    text_sees_images: bool
    cfg_parallel_group: dist.ProcessGroup | None
    mixed_rows: str
    row_loras: RowLoras | None
    cache_budget: CacheBudget | None
    #: the sequence-parallel split of each call (None: the call runs whole)
    sequence_split: SequenceSplit | None
    #: the family has a packed forward (``packed_forward``)
    packs_rows: bool

    # -- the family's -------------------------------------------------------------------
    def encode_with_images(self, request: DiffusionRequest,
                           inputs: InputPixels) -> Conditioning: ...

    def encode_image_dist(self, pixels: torch.Tensor) -> DiagonalGaussianDistribution: ...

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor: ...

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None: ...

    def prepare_timesteps(self, params: SamplingParams
                          ) -> tuple[SchedulerMixin, torch.Tensor]: ...

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor: ...

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor: ...

    def packed_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor: ...

    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> AbstractContextManager[TransformerBlocks]: ...

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor: ...

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor: ...

    # -- the pipeline's (what the runner calls, and the loop through it) ------------------
    def prepared(self, request: DiffusionRequest) -> DiffusionRequest: ...

    def report_step(self) -> None: ...

    def prepare_encode_batch(self, states: list[StepRequestState]) -> None: ...

    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor: ...

    def split_predictions(self, noise_pred: torch.Tensor,
                          states: list[StepRequestState]) -> list[torch.Tensor]: ...

    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None: ...

    def post_decode_batch(self, states: list[StepRequestState]) -> list[RequestOutput]: ...

    def run_transformer(self, latents: torch.Tensor, timesteps: torch.Tensor,
                        embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                        layout: RowLayout) -> torch.Tensor: ...

    def row_layout(self, params: SamplingParams, rows: int | None = None,
                   loras: tuple[tuple[int, float], ...] = (),
                   cond: tuple[tuple[int, int], ...] = (),
                   cache: RequestCache | None = None) -> RowLayout: ...


__all__ = ["FlowMatchHost", "OffloadHost", "SequenceHost"]
