"""The LTX-2 pipeline: diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline``
on the shared denoise loop, video and sound denoised together.

The family's five parts (docs/families.md): prompts through diffusers' own
``encode_prompt`` (Gemma 3's stacked hidden states, left-padded) and the
folder's ``LTX2TextConnectors`` (the video stream's text, the audio
stream's text and the text mask); the transformer call over
``LTX2VideoTransformer3DModel`` with both streams, each row's video and
audio positions built as diffusers builds them (``prepare_video_coords`` at
the clip's frame rate, ``prepare_audio_coords``); rows of video then audio
tokens (``latents.py``); the decode: the video VAE's frames and, beside
them, the audio VAE's mel spectrogram through the vocoder: a waveform
(N, channels, samples) at the vocoder's ``output_sampling_rate``.

The conditioning's ``extra`` (the family's second text output) carries, per
row and text position, the audio stream's text, then the text mask, then
an image-to-video flag (1: the row's first latent frame is the given
frame). A latent size is (F, h, w, L, fps in mHz): the frame rate the
video positions are built at travels with the rows' size, so rows of other
frame rates run in calls of their own (``mixed_rows="by_size"``, whatever
was asked, as for Wan).

Image-to-video (``images=[first frame]``, an ``LTX2ImageToVideoPipeline``
folder), as diffusers does it: the frame is encoded (the mode, normalised)
into the first latent frame's tokens, which then keep timestep 0 (a
per-token timestep) and are restored after every step. diffusers
re-compresses the frame as H.264 first (``image_crf``, 33 by default for
LTX-2.0); diffrt conditions on the frame as given (diffusers' ``image_crf=0``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.interface import RequestOutput, StepRequestState
from diffrt.engine.pipelines.ltx2.latents import AudioVideoLatents, pack_video
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.pipelines.sound import join_sound, sound_transfer, split_sound
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

#: what LTX2Pipeline pads prompts to when its tokenizer's window is wider
TEXT_TOKENS = 1024


def shift_mu(tokens: int, config: Any) -> float:
    """The schedule's shift for ``tokens`` video tokens (diffusers' ``calculate_shift``
    with LTX-2's defaults where the scheduler's config names none)."""
    base, top = config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.95), config.get("max_shift", 2.05)
    m = (high - low) / (top - base)
    return tokens * m + (low - m * base)


class LTX2Pipeline(FlowMatchPipeline):
    """Text- and image-to-video with sound, with diffusers' LTX-2 modules."""

    latents: AudioVideoLatents
    #: the folder's components beyond the base's (``take_components``)
    connectors: Any = None
    audio_vae: Any = None
    vocoder: Any = None
    #: rows of several sizes: a call per size (see the module)
    mixed_rows = "by_size"

    # -- encoders ------------------------------------------------------------------------
    @staticmethod
    def encode_with_diffusers(pipeline: Any, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's stacked hidden states through the text connectors, as
        LTX2Pipeline encodes them: (video text, [audio text, mask, 0])."""
        length = min(TEXT_TOKENS, int(pipeline.tokenizer.model_max_length))
        embeds, mask, _, _ = pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=length,
            device=device)
        connectors = pipeline.connectors
        video, audio, text_mask = connectors(
            embeds.to(connectors.dtype), mask,
            padding_side=getattr(pipeline.tokenizer, "padding_side", "left"))
        marks = torch.stack([text_mask.to(audio.dtype), torch.zeros_like(audio[..., 0])], -1)
        return video, torch.cat([audio, marks], dim=-1)

    @staticmethod
    def prompt_windows(pipeline: Any) -> list[PromptWindow]:
        length = min(TEXT_TOKENS, int(pipeline.tokenizer.model_max_length))
        return [PromptWindow("text_encoder", pipeline.tokenizer, length)]

    def take_components(self, pipeline: Any) -> None:
        """The text connectors (the prompts' encoder runs them), the audio VAE
        and the vocoder; the rows' audio features from the audio VAE."""
        from diffrt.engine.pipelines.components import place

        place(pipeline.connectors, self.device)
        self.audio_vae = place(pipeline.audio_vae, self.device)
        self.vocoder = place(pipeline.vocoder, self.device)
        config = self.audio_vae.config
        ratio = int(self.audio_vae.temporal_compression_ratio)
        self.latents.set_audio(int(config.latent_channels),
                               int(config.mel_bins) // int(self.audio_vae.mel_compression_ratio),
                               float(config.sample_rate) / float(config.mel_hop_length) / ratio)

    def weight_modules(self) -> dict[str, torch.nn.Module]:
        modules = super().weight_modules()
        modules.update(audio_vae=self.audio_vae, vocoder=self.vocoder)
        return modules

    def use_mixed_rows(self, arrangement: str) -> None:
        """A call per size (see the module)."""
        if arrangement != "by_size":
            logger.info("%s: mixed_rows %s runs as by_size (one rotary table a call)",
                        self.name, arrangement)
        self.mixed_rows = "by_size"

    # -- latent layout and schedule ------------------------------------------------------
    def latent_layout(self, vae_config: dict[str, Any]) -> AudioVideoLatents:
        config = self.transformer.config
        patch, patch_t = int(config.patch_size), int(config.patch_size_t)
        return AudioVideoLatents(int(vae_config["latent_channels"]),
                                 int(self.vae.spatial_compression_ratio),
                                 int(self.vae.temporal_compression_ratio), patch, patch_t)

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        """LTX2Pipeline's sigmas (1 to 1/steps) shifted by the video's tokens."""
        import numpy as np

        tokens = self.latents.video_tokens(self.latents.size(params))
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps),
                "mu": shift_mu(tokens, self.noise_scheduler.config)}

    # -- transformer call --------------------------------------------------------------
    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' forward over rows of one size (``by_size``): both streams,
        an image-to-video row's first latent frame at timestep 0."""
        if not layout.uniform:
            raise ValueError("LTX-2 runs rows of one size per call (mixed_rows=by_size)")
        size = layout.sizes[0]
        f, h, w, length, fps_mhz = size
        fps = fps_mhz / 1000
        lat = self.latents
        video, audio = lat.split(latents, size)
        rows, frame = latents.shape[0], h * w // (lat.patch * lat.patch)
        i2v = extra[:, 0, -1] > 0.5
        timestep = timesteps
        if bool(i2v.any()):  # per-token timesteps: 0 on a given first frame
            timestep = timesteps[:, None].repeat(1, video.shape[1])
            timestep[i2v, :frame] = 0
        model = self.denoiser(layout)
        video_coords = model.rope.prepare_video_coords(rows, f, h, w, latents.device, fps=fps)
        audio_coords = model.audio_rope.prepare_audio_coords(rows, length, latents.device)
        mask = extra[..., -2]
        pred_video, pred_audio = model(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=embeds,
            audio_encoder_hidden_states=extra[..., :-2], timestep=timestep,
            audio_timestep=timesteps, sigma=timesteps, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=fps,
            audio_num_frames=length, video_coords=video_coords, audio_coords=audio_coords,
            isolate_modalities=False, spatio_temporal_guidance_blocks=None,
            perturbation_mask=None, use_cross_timestep=True, return_dict=False)
        return lat.join(pred_video.float(), pred_audio.float()).to(latents.dtype)

    # -- image-to-video ----------------------------------------------------------------
    def encode_image_dist(self, pixels: torch.Tensor) -> Any:
        """The first frame ((B, 3, H, W)) as a one-frame clip's latent
        distribution; its mean (the mode) is what diffusers conditions on."""
        dist = self.vae.encode(pixels[:, :, None], return_dict=False)[0]
        return SimpleNamespace(mean=dist.mode(), std=torch.zeros_like(dist.mode()))

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(latents - mean) / std per channel (LTX2ImageToVideoPipeline's
        ``_normalize_latents`` at its scaling factor 1)."""
        mean, std = self.latent_stats(latents)
        return (latents - mean) / std

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """The first latent frame's tokens become the frame's (kept there by
        ``apply_step``); the rows' flag marks them (see the module)."""
        params = state.request.sampling_params
        tokens = pack_video(image_latents[0].to(self.device, self.dtype), self.latents.patch,
                            self.latents.patch_t)
        tokens = tokens.repeat(params.num_outputs_per_prompt, 1, 1)
        state.family_state = tokens
        self.keep_first_frame(state)
        cond = state.cond
        assert cond is not None  # prepared before its images

        def flagged(extra: torch.Tensor) -> torch.Tensor:
            extra = extra.clone()
            extra[..., -1] = 1
            return extra

        state.cond = Conditioning(cond.embeds, flagged(cond.extra), cond.neg_embeds,
                                  None if cond.neg_extra is None else flagged(cond.neg_extra))

    def keep_first_frame(self, state: StepRequestState) -> None:
        """An image-to-video request's first latent frame back to its frame's tokens."""
        tokens = state.family_state
        latents = state.latents
        if tokens is None or latents is None:
            return
        latents = latents.clone()
        latents[:, :tokens.shape[1], :tokens.shape[2]] = tokens
        state.latents = latents

    @torch.no_grad()
    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        """The loop's step; an image-to-video request's first frame kept."""
        super().apply_step(state, noise_pred)
        self.keep_first_frame(state)

    # -- decode ------------------------------------------------------------------------
    def latent_stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The video VAE's per-channel ``latents_mean`` and ``latents_std``, (1, C, 1, 1, 1)."""
        shape = (1, -1, 1, 1, 1)
        return (self.vae.latents_mean.view(shape).to(latents.device, latents.dtype),
                self.vae.latents_std.view(shape).to(latents.device, latents.dtype))

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Rows -> each output's frames and waveform as one float32 row
        (``sound.join_sound``): the shared loop splits, batches and clones a
        request's outputs as rows of one tensor; ``to_transfer`` parts them."""
        return join_sound(self.decode_frames(latents, params), self.decode_audio(latents, params))

    def decode_frames(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Rows -> frames in [-1, 1], (N, 3, frames, H, W)."""
        spatial = self.latents.unpack(latents, self.latents.size(params))
        mean, std = self.latent_stats(spatial)
        spatial = spatial * std / float(self.vae.config.scaling_factor) + mean
        video = self.vae.decode(spatial.to(self.dtype), None, return_dict=False)[0]
        return video.clamp(-1, 1)

    def decode_audio(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Rows -> the waveform, (N, channels, samples) float32: the audio
        tokens denormalised, the audio VAE's mel spectrogram, the vocoder."""
        _, audio = self.latents.split(latents, self.latents.size(params))
        vae = self.audio_vae
        audio = audio * vae.latents_std.to(audio) + vae.latents_mean.to(audio)
        mel = vae.decode(self.latents.unpack_audio(audio).to(self.dtype), return_dict=False)[0]
        return self.vocoder(mel).float()

    @property
    def sample_rate(self) -> int:
        """The waveform's samples a second (the vocoder's ``output_sampling_rate``)."""
        return int(self.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The preview's frames (its sound is not sent)."""
        joined = super().decode_preview(state)
        if joined is None:
            return None
        return split_sound(joined, state.request.sampling_params,
                           int(self.vocoder.config.out_channels))[0]

    def to_transfer(self, output: RequestOutput, params: SamplingParams) -> Any:
        """Frames as uint8 (the base's), the waveform float32 and its rate
        (``sound.SOUND_KEYS``); a preview's frames alone (LTX-2 makes no
        rollout: its outputs are never the rollout's dict)."""
        if not isinstance(output, torch.Tensor) or output.dim() != 2:  # a preview's frames
            return super().to_transfer(output, params)
        frames, waveform = split_sound(output, params, int(self.vocoder.config.out_channels))
        return sound_transfer(quantize_images(frames), waveform, self.sample_rate)


__all__ = ["LTX2Pipeline", "shift_mu"]
