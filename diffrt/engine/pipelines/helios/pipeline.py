"""The Helios pipeline: diffusers' ``HeliosPipeline`` on the shared denoise loop.

A Helios clip is denoised in chunks of ``ModelSpec.chunk_latent_frames``
latent frames, one after another, each with the latents of the chunks
before it as context (``history.py``), each decoded as soon as it is done.
How such a request fits a loop that advances requests one step at a time:

- **Its steps are its chunks' steps.** ``SamplingParams.chunks`` (set by
  the spec from ``num_frames``) makes ``denoise_steps()`` chunks x steps, so
  the engine's records, progress, scheduling and cost estimates count the
  whole clip; step ``s`` is step ``s % steps`` of chunk ``s // steps`` (its
  timesteps are the chunk schedule repeated). Between two chunks nothing
  leaves the step batch: ``apply_step`` ends a chunk in place — its latents
  join the history, its frames are decoded (as diffusers decodes each
  chunk), the next chunk's noise is drawn from the request's own
  generator, its noise scheduler is reset — so a request at chunk 3 steps
  beside one at chunk 0, or beside another of another length or size.
- **Its history rides as conditioning.** A row's history is the same for a
  whole chunk, so it is the row's ``Conditioning.extra`` (replaced at each
  chunk's end), which the loop batches, repeats for CFG and cuts per size
  like any per-row conditioning; the frame indices are the same for every
  row. Rows of one size share one transformer call; rows of several sizes
  a call per size (``by_size``: Wan's padded call does not carry the
  history inputs).
- **Each finished chunk is a streamed output.** ``SamplingParams.preview_steps``
  are a chunked request's chunk ends, so the worker stops a multi-step tick
  there and sends the chunk's frames (``decode_preview``: the frames
  ``apply_step`` decoded, nothing decoded twice) through the preview path:
  a ``step_streaming`` consumer gets a progress item whose ``preview`` is
  the chunk's frames and ``preview_index`` the chunk's number. The final
  output is every chunk's frames, cut to ``num_frames`` as diffusers cuts
  them. Request-batch execution runs the same steps for a whole batch in one
  call (``forward``), so its clip is the same; it streams nothing.

Not run on Helios (the spec refuses each, naming its field): input images,
LoRA, step caches, lower-precision weights, offload, multi-rank splits.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from diffrt.engine.pipelines.denoise import check_compatible, prepared
from diffrt.engine.pipelines.helios.history import (
    HISTORY_SIZES,
    ChunkState,
    frame_indices,
    history_inputs,
)
from diffrt.engine.pipelines.interface import (
    DiffusionRequestBatch,
    RequestOutput,
    StepRequestState,
)
from diffrt.engine.pipelines.latents import LatentSize
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.pipelines.wan.latents import VideoLatents
from diffrt.engine.pipelines.wan.pipeline import WanPipeline
from diffrt.engine.sampling import SamplingParams, filled


class ChunkLatents(VideoLatents):
    """Wan's video latents, a request's size being one chunk's (``chunk``
    latent frames, set from the spec once loaded)."""

    chunk = 1

    def size(self, params: SamplingParams) -> LatentSize:
        _, h, w = super().size(params)
        return (self.chunk, h, w)


def calculate_shift(tokens: int, config: Any) -> float:
    """HeliosPipeline's ``mu`` for a chunk of ``tokens`` patches (Flux's
    ``calculate_shift`` over the scheduler's config)."""
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (high - low) / (top - base)
    return tokens * m + low - m * base


class HeliosPipeline(WanPipeline):
    """Chunked text-to-video with diffusers' ``HeliosTransformer3DModel`` (see the module)."""

    latents: ChunkLatents

    def latent_layout(self, vae_config: dict[str, Any]) -> ChunkLatents:
        wan = super().latent_layout(vae_config)
        return ChunkLatents(wan.channels, wan.factor, wan.temporal, wan.patch)

    def take_components(self, pipeline: Any) -> None:
        """The chunk length, from the spec (HeliosPipeline has one transformer)."""
        self.latents.chunk = self.spec.chunk_latent_frames
        self.indices = {k: v.to(self.device)
                        for k, v in frame_indices(self.spec.chunk_latent_frames).items()}

    #: rows of several sizes run a call per size whatever was asked: Wan's
    #: padded call (a 3-D rotary table per row, ``wan/rows.py``) does not
    #: carry the history inputs of Helios' forward
    mixed_rows = "by_size"

    def use_mixed_rows(self, arrangement: str) -> None:
        self.mixed_rows = "by_size"

    # -- schedule --------------------------------------------------------------------
    def prepare_timesteps(self, params: SamplingParams) -> tuple[Any, torch.Tensor]:
        """A fresh HeliosScheduler set as HeliosPipeline sets it for each
        chunk (sigmas from 0.999 down, ``mu`` from a chunk's tokens); the
        timesteps are that schedule once per chunk (see the module)."""
        noise_scheduler = copy.deepcopy(self.noise_scheduler)
        steps = filled(params.num_inference_steps)
        mu = calculate_shift(self.latents.tokens(self.latents.size(params)),
                             noise_scheduler.config)
        noise_scheduler.set_timesteps(steps, device=self.device,
                                      sigmas=np.linspace(0.999, 0.0, steps + 1)[:-1], mu=mu)
        return noise_scheduler, noise_scheduler.timesteps.repeat(params.chunks)

    # -- transformer call --------------------------------------------------------------
    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' forward over rows of one size, each with its history (``extra``)."""
        if not layout.uniform:
            raise ValueError("Helios runs rows of one size per call (mixed_rows=by_size)")
        size = layout.sizes[0]
        long, mid, short = history_inputs(extra, size[1], size[2])
        pred = self.denoiser(layout)(
            hidden_states=self.latents.unpack(latents, size), timestep=timesteps,
            encoder_hidden_states=embeds, latents_history_long=long, latents_history_mid=mid,
            latents_history_short=short, return_dict=False, **self.indices)[0]
        return self.latents.pack(pred)

    def transformer_blocks(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name} cuts no transformer call at its blocks")

    # -- the step protocol -----------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: DiffusionRequestBatch) -> list[RequestOutput]:
        """A whole batch through the step protocol (each request its own
        chunks' state; equal batch keys: they finish together)."""
        batch = DiffusionRequestBatch([self.prepared(r) for r in batch.requests], batch.loras,
                                      batch.inputs)
        check_compatible(batch.requests, self.spec.request_batch_key)
        return self.loop.forward_in_steps(batch)

    @torch.no_grad()
    def prepare_encode_batch(self, states: list[StepRequestState]) -> None:
        """The loop's preparation, then each request's chunk state: its
        generator (which draws chunk 0's noise again, then the next
        chunks'), an empty history."""
        self.loop.prepare_encode_batch(states)
        for state in states:
            params = state.request.sampling_params
            generator = torch.Generator(device="cpu").manual_seed(prepared(state.seed))
            _, h, w = self.latents.size(params)
            history = torch.zeros(params.num_outputs_per_prompt, self.latents.channels,
                                  sum(HISTORY_SIZES), h, w, device=self.device)
            state.family_state = ChunkState(generator, history)
            self.start_chunk(state)

    def start_chunk(self, state: StepRequestState) -> None:
        """The next chunk's noise, noise scheduler and history tokens."""
        chunks: ChunkState = state.family_state
        params = state.request.sampling_params
        noise = self.latents.noise(params, chunks.generator)
        state.latents = self.latents.pack(noise.to(self.device, self.dtype))
        state.noise_scheduler, _ = self.prepare_timesteps(params)
        tokens = chunks.history_tokens().to(self.dtype)
        cond = prepared(state.cond)
        state.cond = Conditioning(cond.embeds, tokens, cond.neg_embeds,
                                  None if cond.neg_embeds is None else tokens)

    @torch.no_grad()
    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        """The chunk's scheduler step; at a chunk's last step its end (see the module)."""
        t = prepared(state.timesteps)[state.step]
        state.latents = prepared(state.noise_scheduler).step(
            noise_pred, t, prepared(state.latents), return_dict=False)[0]
        state.step += 1
        params = state.request.sampling_params
        if state.step % filled(params.num_inference_steps):
            return
        chunks: ChunkState = state.family_state
        latents = self.latents.unpack(state.latents, self.latents.size(params)).float()
        output = latents if params.output_type == "latent" else \
            self.decode_latents(state.latents, params)
        chunks.add(latents, output)
        if not state.finished:
            self.start_chunk(state)

    @torch.no_grad()
    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The chunk that just finished (decoded by ``apply_step``)."""
        chunks: ChunkState = state.family_state
        fresh, chunks.fresh = chunks.fresh, None
        return fresh

    @torch.no_grad()
    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """Every chunk's frames, cut to ``num_frames`` (latents: every chunk's)."""
        chunks: ChunkState = state.family_state
        params = state.request.sampling_params
        clip = torch.cat(chunks.outputs, dim=2)
        return clip if params.output_type == "latent" else clip[:, :, :filled(params.num_frames)]

    @torch.no_grad()
    def post_decode_batch(self, states: list[StepRequestState]) -> list[RequestOutput]:
        return [self.post_decode(state) for state in states]


__all__ = ["HeliosPipeline"]
