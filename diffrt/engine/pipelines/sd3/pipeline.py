"""SD3 family: SD3Transformer2DModel, its latents kept as patch tokens.

Only what is SD3-specific lives here: the transformer call (timesteps in
[0, 1000]) and the latents' layout. diffusers' transformer takes spatial
latents and patchifies them itself; diffrt keeps them as its patch tokens
(``patches.py``) so that rows of different sizes can be padded into one call
(``mixed.py``) as Flux's packed tokens are. A call of one size unpacks them
and runs diffusers' own forward, unchanged; the layout only moves values, so
its images are the same either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.flow_match_spec import vae_factor
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.packed_latents import calculate_shift
from diffrt.engine.pipelines.sd3.patches import PatchLatents, patchify, unpatchify
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline

    from diffrt.engine.pipelines.sd3.blocks import SD3Blocks


class SD3Pipeline(FlowMatchPipeline):
    """Text-to-image with a diffusers SD3Transformer2DModel."""

    @staticmethod
    def encode_with_diffusers(pipeline: StableDiffusion3Pipeline, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two CLIPs (penultimate hidden states, pooled) and T5 (256 tokens),
        concatenated as StableDiffusion3Pipeline does."""
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            num_images_per_prompt=1, do_classifier_free_guidance=False, max_sequence_length=256)
        return embeds, pooled

    @staticmethod
    def prompt_windows(pipeline: StableDiffusion3Pipeline) -> list[PromptWindow]:
        """Both CLIPs at ``tokenizer_max_length`` (77) and T5, where the folder
        has one, at the 256 tokens ``encode_with_diffusers`` asks."""
        windows = [PromptWindow("text_encoder", pipeline.tokenizer, pipeline.tokenizer_max_length),
                   PromptWindow("text_encoder_2", pipeline.tokenizer_2,
                                pipeline.tokenizer_max_length)]
        if pipeline.text_encoder_3 is not None:
            windows.append(PromptWindow("text_encoder_3", pipeline.tokenizer_3, 256))
        return windows

    latents: PatchLatents

    @property
    def patch(self) -> int:
        """Latents per token side (the transformer's ``patch_size``)."""
        return int(self.transformer.config.patch_size)

    def latent_layout(self, vae_config: dict[str, Any]) -> PatchLatents:
        """One token a ``patch`` x ``patch`` latent patch (``patches.py``)."""
        return PatchLatents(int(vae_config["latent_channels"]), vae_factor(vae_config),
                            self.patch)

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        """``mu`` when the noise scheduler shifts dynamically (SD3.5 configs), from
        the latent patch count, as StableDiffusion3Pipeline computes it."""
        cfg = self.noise_scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return {}
        seq_len = self.latents.tokens(self.latents.size(params))
        return {"mu": calculate_shift(seq_len, cfg.get("base_image_seq_len", 256),
                                      cfg.get("max_image_seq_len", 4096),
                                      cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))}

    @contextlib.contextmanager
    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> Iterator[SD3Blocks]:
        from diffrt.engine.pipelines.sd3.blocks import SD3Blocks
        from diffrt.engine.pipelines.sd3.mixed import rows_processor

        model = self.eager_transformer
        with contextlib.nullcontext() if layout.uniform else rows_processor(model):
            yield SD3Blocks(model, hidden_states=latents, encoder_hidden_states=embeds,
                            pooled_projections=pooled, timestep=timesteps, layout=layout)

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' own forward over rows of one size (its spatial input
        from the patch tokens; timesteps float32 whatever the model dtype, as
        diffusers passes them)."""
        out = self.denoiser(layout)(
            hidden_states=unpatchify(latents, layout.sizes[0], self.patch),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=timesteps,
            return_dict=False,
        )[0]
        return patchify(out, self.patch)

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """Rows of several sizes: padded patch tokens, masked keys (``mixed.py``)."""
        from diffrt.engine.pipelines.sd3.mixed import forward_rows

        return forward_rows(self.denoiser(layout), hidden_states=latents,
                            encoder_hidden_states=embeds, pooled_projections=pooled,
                            timestep=timesteps, layout=layout)

    def sequence_hooks(self, split: SequenceSplit) -> None:
        """The patch embedding (which adds the positional embedding, so it
        sees the whole latent) is followed by the shard, the last projection
        by the gather (before diffusers un-patchifies); the attention goes
        over the sequence group (``pipelines.sd3.parallel``), text whole on
        every rank."""
        from diffrt.engine.parallel.sequence import GatherTokens, ShardTokens
        from diffrt.engine.pipelines.sd3.parallel import SequenceParallelJointAttnProcessor

        model = self.transformer
        model.set_attn_processor(SequenceParallelJointAttnProcessor(split))
        model.pos_embed = ShardTokens(model.pos_embed, split)
        model.proj_out = GatherTokens(model.proj_out, split)
