"""SD3 family: SD3Transformer2DModel on spatial latents (it patchifies itself).

Only what is SD3-specific lives here: the transformer call (timesteps in
[0, 1000]) and the size limit from its positional-embedding grid.
"""

from __future__ import annotations

from typing import Any

import torch

from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.sampling import SamplingParams


class SD3Pipeline(FlowMatchPipeline):
    """Text-to-image with a diffusers SD3Transformer2DModel."""

    @staticmethod
    def encode_with_diffusers(pipeline: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two CLIPs (penultimate hidden states, pooled) and T5 (256 tokens),
        concatenated as StableDiffusion3Pipeline does."""
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=pipeline.text_encoder.device,
            num_images_per_prompt=1, do_classifier_free_guidance=False, max_sequence_length=256)
        return embeds, pooled

    @staticmethod
    def prompt_windows(pipeline: Any) -> list[PromptWindow]:
        """Both CLIPs at ``tokenizer_max_length`` (77) and T5, where the folder
        has one, at the 256 tokens ``encode_with_diffusers`` asks."""
        windows = [PromptWindow("text_encoder", pipeline.tokenizer, pipeline.tokenizer_max_length),
                   PromptWindow("text_encoder_2", pipeline.tokenizer_2,
                                pipeline.tokenizer_max_length)]
        if pipeline.text_encoder_3 is not None:
            windows.append(PromptWindow("text_encoder_3", pipeline.tokenizer_3, 256))
        return windows

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        """``mu`` when the noise scheduler shifts dynamically (SD3.5 configs), from
        the latent patch count, as StableDiffusion3Pipeline computes it."""
        cfg = self.noise_scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return {}
        from diffrt.engine.pipelines.flux.pipeline import calculate_shift

        patch = self.transformer.config.patch_size
        h, w = self.latent_size(params)
        seq_len = (h // patch) * (w // patch)
        return {"mu": calculate_shift(seq_len, cfg.get("base_image_seq_len", 256),
                                      cfg.get("max_image_seq_len", 4096),
                                      cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))}

    def transformer_forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        embeds: torch.Tensor,
        pooled: torch.Tensor,
        guidance: torch.Tensor,
        layout: RowLayout,
    ) -> torch.Tensor:
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=timesteps,  # float32 whatever the model dtype, as diffusers passes them
            return_dict=False,
        )[0]

    def enable_sequence_parallel(self, groups: Any) -> None:
        """Each rank runs the transformer blocks on its slice of the image
        tokens: the patch embedding (which adds the positional embedding, so
        it sees the whole latent) is followed by the split, the last
        projection by the gather; the attention goes over the sequence group
        (``pipelines.sd3.parallel``), text whole on every rank."""
        from diffrt.engine.parallel.sequence import GatherTokens, SequenceSplit, ShardTokens
        from diffrt.engine.pipelines.sd3.parallel import SequenceParallelJointAttnProcessor

        sequence = SequenceSplit(groups.sequence, groups.sequence_attention())
        model = self.transformer
        model.set_attn_processor(SequenceParallelJointAttnProcessor(sequence))
        model.pos_embed = ShardTokens(model.pos_embed, sequence)
        model.proj_out = GatherTokens(model.proj_out, sequence)
