"""Qwen-Image family: QwenImageTransformer2DModel behind Qwen2.5-VL prompts.

It shares Flux's latent layout (2x2-packed tokens), sigma schedule
(``linspace(1, 1/n, n)`` shifted by the image's token count) and an edit's
input-image tokens: ``packed_latents``, the module both families use; and
its true-CFG semantics (``true_cfg_scale`` > 1 with a negative prompt;
diffusers' default scale 4.0) are its spec's. What is its own:

- prompts: Qwen2.5-VL in a chat template, the template's 34 leading tokens
  dropped (diffusers' ``encode_prompt``), **no fixed length**: a prompt's
  embedding is as long as its tokens, so the text mask travels with it
  (``Conditioning.extra``) and rows of different lengths are zero-padded and
  masked when they share a batch, as diffusers pads a batch;
- guidance: after combining the two branches, the result is rescaled to the
  conditional prediction's norm per token (``combine_guidance``);
- the transformer call (image shapes for its rotary embedding, the mask;
  rows of different sizes through ``mixed.py``, frequencies per row);
- the VAE (``AutoencoderKLQwenImage``): 3-D latents with one frame,
  per-channel ``latents_mean``/``latents_std`` instead of a scaling factor,
  8x from its temporal-downsample list.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.input_images import InputPixels
from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.flow_match_spec import qwen_vae_factor
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.packed_latents import PackedFamily, PackedLatents
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers import QwenImagePipeline as DiffusersQwenImage
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from diffrt.engine.pipelines.qwen_image.blocks import QwenImageBlocks


class QwenImagePipeline(PackedFamily, FlowMatchPipeline):
    """Text-to-image with a diffusers QwenImageTransformer2DModel."""

    latents: PackedLatents

    @staticmethod
    def encode_with_diffusers(pipeline: DiffusersQwenImage, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2.5-VL's last hidden states without the template prefix, padded
        to the longest prompt, and their mask (1 = a token)."""
        embeds, mask = pipeline.encode_prompt(prompt=prompts, device=device,
                                              num_images_per_prompt=1, max_sequence_length=1024)
        if mask is None:  # diffusers drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    @staticmethod
    def prompt_windows(pipeline: DiffusersQwenImage) -> list[PromptWindow]:
        """Qwen2.5-VL's tokenizer cuts the prompt in its chat template at 1024
        tokens past the template's dropped prefix, as ``encode_prompt`` does."""
        return [PromptWindow("text_encoder", pipeline.tokenizer,
                             pipeline.tokenizer_max_length
                             + pipeline.prompt_template_encode_start_idx,
                             pipeline.prompt_template_encode)]

    def latent_layout(self, vae_config: dict[str, Any]) -> PackedLatents:
        """AutoencoderKLQwenImage's ``z_dim`` channels, 2 x 2-packed."""
        return PackedLatents(int(vae_config.get("z_dim", 16)), qwen_vae_factor(vae_config))

    def prepare_timesteps(self, params: SamplingParams
                          ) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """As QwenImagePipeline: stepping starts at index 0 (``set_begin_index``);
        with its terminal sigma the scheduler cannot find the first timestep
        by value."""
        noise_scheduler, timesteps = super().prepare_timesteps(params)
        noise_scheduler.set_begin_index(0)
        return noise_scheduler, timesteps

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
        """As QwenImagePipeline: the guided prediction rescaled per token to
        the conditional prediction's norm."""
        combined = super().combine_guidance(cond, uncond, scale)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        return combined * (cond_norm / torch.norm(combined, dim=-1, keepdim=True))

    def image_shapes(self, layout: RowLayout) -> list[list[tuple[int, int, int]]]:
        """The transformer's rotary embedding input: one frame of packed tokens
        a row, and an edit's input image as the next frame (as
        QwenImageEditPipeline's ``img_shapes``)."""
        return [[(1, h // 2, w // 2)] + [(1, ch // 2, cw // 2) for ch, cw in layout.cond_of(row)]
                for row, (h, w) in enumerate(layout.sizes)]

    text_sees_images = True

    @staticmethod
    def preloaded_components(folder: str) -> dict[str, Any]:
        """An edit folder's Qwen2-VL processor (``vl_processor``: transformers
        builds it only with torchvision, which this CPU stack lacks)."""
        import os

        from diffrt.engine.models.folder_check import read_json_object

        index = read_json_object(os.path.join(folder, "model_index.json"))
        if "processor" not in index:
            return {}
        from diffrt.engine.models.vl_processor import load_vl_processor

        return {"processor": load_vl_processor(os.path.join(folder, "processor"))}

    def encode_with_images(self, request: DiffusionRequest, inputs: InputPixels) -> Conditioning:
        """The edit pipeline's own ``encode_prompt`` with the resized input
        image (Qwen-Image-Edit) or images at their text encoder's size (its
        Plus variant: "Picture 1: ..."), for the prompt and (when CFG runs)
        the negative prompt apart, as diffusers calls it."""
        from PIL import Image

        from diffrt.engine.pipelines.folder_text import FolderTextEncoder
        from diffrt.engine.pipelines.prompt_cache import CachedTextEncoder

        text = self.text_encoder
        if isinstance(text, CachedTextEncoder):  # past the prompt cache
            text = text.encoder
        assert isinstance(text, FolderTextEncoder), "Qwen-Image encodes through its folder"
        pipeline = text.pipeline
        pictures = [Image.fromarray(image.numpy())
                    for image in (inputs.prompt_images or inputs.images)]
        picture = pictures if inputs.prompt_images is not None else pictures[0]

        def encode(prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
            embeds, mask = pipeline.encode_prompt(prompt=[prompt], image=picture,
                                                  device=self.device,
                                                  num_images_per_prompt=1,
                                                  max_sequence_length=1024)
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            n = request.sampling_params.num_outputs_per_prompt
            return (embeds.to(self.device, self.dtype).repeat_interleave(n, 0),
                    mask.to(self.device, self.dtype).repeat_interleave(n, 0))

        embeds, mask = encode(request.prompt)
        if not self.spec.uses_cfg(request):
            return Conditioning(embeds, mask)
        return Conditioning(embeds, mask, *encode(self.spec.negative_prompt(request) or ""))

    @contextlib.contextmanager
    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> Iterator[QwenImageBlocks]:
        from diffrt.engine.pipelines.qwen_image.blocks import QwenImageBlocks
        from diffrt.engine.pipelines.qwen_image.mixed import row_rotary, rows_processor

        mask = extra.to(torch.bool)
        timestep = timesteps.to(latents.dtype) / 1000
        model = self.eager_transformer
        if layout.uniform:
            embedded = guidance.to(latents.dtype) if model.config.guidance_embeds else None
            yield QwenImageBlocks(model, hidden_states=latents, encoder_hidden_states=embeds,
                                  timestep=timestep, guidance=embedded,
                                  img_shapes=self.image_shapes(layout),
                                  text_mask=None if mask.all() else mask)
            return
        rotary = row_rotary(model, self.image_shapes(layout), embeds.shape[1], layout.longest,
                            latents.device)
        keys = torch.cat([mask, layout.key_mask(0, latents.device)], dim=1)
        with rows_processor(model):
            yield QwenImageBlocks(model, hidden_states=latents, encoder_hidden_states=embeds,
                                  timestep=timestep, guidance=None, rotary=rotary, key_mask=keys)

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' own forward over rows of one size; under the sequence
        split this rank's image tokens (their rotary rows by the hooks), the
        text and its mask whole."""
        mask = extra.to(torch.bool)
        # as QwenImagePipeline: the model dtype first, then scaled
        timestep = timesteps.to(latents.dtype) / 1000
        embedded = guidance.to(latents.dtype) if self.transformer.config.guidance_embeds else None
        text_mask = None if mask.all() else mask
        sequence = self.sequence_split
        if sequence is not None:  # begun by the call layer; a no-op when it runs whole
            latents = sequence.shard(latents, 1)
            sequence.text_mask = text_mask
        return self.denoiser(layout)(
            hidden_states=latents,
            timestep=timestep,
            guidance=embedded,
            encoder_hidden_states_mask=text_mask,
            encoder_hidden_states=embeds,
            img_shapes=self.image_shapes(layout),
            return_dict=False,
        )[0]

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """Rows of several sizes: frequencies per row and one key mask, each
        row's text (its prompt's padding out) then its image tokens (``mixed.py``)."""
        from diffrt.engine.pipelines.qwen_image.mixed import forward_rows, row_rotary

        model = self.denoiser(layout)
        rotary = row_rotary(model, self.image_shapes(layout), embeds.shape[1], layout.longest,
                            latents.device)
        keys = torch.cat([extra.to(torch.bool), layout.key_mask(0, latents.device)], dim=1)
        return forward_rows(model, hidden_states=latents, encoder_hidden_states=embeds,
                            timestep=timesteps.to(latents.dtype) / 1000, rotary=rotary,
                            key_mask=keys)

    def encode_image_dist(self, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        """AutoencoderKLQwenImage encodes video: the image is one frame."""
        return self.vae.encode(pixels.unsqueeze(2), return_dict=False)[0]

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Per-channel statistics, as QwenImageImg2ImgPipeline's
        ``_encode_vae_image`` applies them; back to one (N, C, h, w) frame."""
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        return ((latents - mean) * inv_std)[:, :, 0]

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Packed latents -> images in [-1, 1], with the VAE's per-channel
        statistics (computed as QwenImagePipeline does, for the same bits)."""
        spatial = self.latents.unpack(latents, self.latents.size(params)).unsqueeze(2).to(
            self.dtype)
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(spatial.device,
                                                                          spatial.dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(spatial.device,
                                                                                  spatial.dtype)
        spatial = spatial / inv_std + mean
        images = self.vae.decode(spatial, return_dict=False)[0][:, :, 0]
        return images.clamp(-1, 1)

    def sequence_hooks(self, split: SequenceSplit) -> None:
        """Attention over the sequence group with the text mask, each rank's
        rows of the rotary table, the output gathered at the last projection
        (``pipelines.qwen_image.parallel``); the image tokens are sharded in
        ``transformer_forward``."""
        from diffrt.engine.pipelines.qwen_image.parallel import enable_qwen_sequence_parallel

        enable_qwen_sequence_parallel(self.transformer, split)
