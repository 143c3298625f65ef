"""Flux family: FluxTransformer2DModel on 2x2-packed latent tokens.

Only what is Flux-specific lives here: its prompts (CLIP pooled + T5), its
transformer call (position ids, embedded guidance, timesteps scaled to
[0, 1]) as the entries the call layers of ``transformer_call`` reach —
``transformer_forward`` for rows of one size, ``padded_forward`` and
``packed_forward`` for rows of several (``mixed.py``, ``packed.py``),
``transformer_blocks`` for step caches — and its sequence split's hooks. Its latent layout (2 x 2-packed tokens, the shifted
sigmas, an edit's tokens) is ``packed_latents``', shared with Qwen-Image
(the tiny seeded folder behind `tiny-flux` is ``tiny_folder.py``'s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.parallel.sequence import SequenceSplit
from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.flow_match_spec import vae_factor
from diffrt.engine.pipelines.flux.blocks import FluxBlocks
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.packed_latents import PackedFamily, PackedLatents, calculate_shift
from diffrt.engine.pipelines.segments import RowLayout

if TYPE_CHECKING:
    from diffusers import FluxPipeline as DiffusersFlux


class FluxPipeline(PackedFamily, FlowMatchPipeline):
    """Text-to-image with a diffusers FluxTransformer2DModel."""

    latents: PackedLatents

    @staticmethod
    def encode_with_diffusers(pipeline: DiffusersFlux, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIP pooled output + T5 hidden states, as FluxPipeline does: 512 T5
        tokens (its default), or fewer when the folder's T5 tokenizer says its
        model saw fewer (``model_max_length``: a model trained on 16 tokens
        must not be given 512)."""
        length = min(512, int(getattr(pipeline.tokenizer_2, "model_max_length", 512)))
        embeds, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=device,
            num_images_per_prompt=1, max_sequence_length=length)
        return embeds, pooled

    @staticmethod
    def prompt_windows(pipeline: DiffusersFlux) -> list[PromptWindow]:
        """CLIP at the pipeline's ``tokenizer_max_length`` (77), T5 at the
        length ``encode_with_diffusers`` asks."""
        length = min(512, int(getattr(pipeline.tokenizer_2, "model_max_length", 512)))
        return [PromptWindow("text_encoder", pipeline.tokenizer, pipeline.tokenizer_max_length),
                PromptWindow("text_encoder_2", pipeline.tokenizer_2, length)]

    def latent_layout(self, vae_config: dict[str, Any]) -> PackedLatents:
        """2 x 2 latent patches a token (``packed_latents``)."""
        return PackedLatents(int(vae_config["latent_channels"]), vae_factor(vae_config))

    def row_ids(self, size: tuple[int, ...], conds: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """A row's token positions (``PackedLatents.row_ids``)."""
        return self.latents.row_ids(size, conds, self.device)

    def _call_inputs(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor,
                     guidance: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor,
                                                      torch.Tensor]:
        """(embedded guidance, text ids, timestep) as FluxPipeline passes them."""
        # Guidance-distilled checkpoints (guidance_embeds=True) take the scale as
        # an input; others ignore it (true CFG is true_cfg_scale's business).
        embedded = guidance.to(latents.dtype) if self.transformer.config.guidance_embeds else None
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device)
        # as FluxPipeline: cast to the model dtype first, then scale (in bf16
        # the other order rounds differently)
        return embedded, txt_ids, timesteps.to(latents.dtype) / 1000

    def _row_rotary(self, txt_ids: torch.Tensor, layout: RowLayout
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A rotary table per row, for rows of several sizes."""
        from diffrt.engine.pipelines.flux.mixed import row_rotary

        rows = [(size, layout.cond_of(i)) for i, size in enumerate(layout.sizes)]
        ids = {row: self.row_ids(*row) for row in set(rows)}
        return row_rotary(self.eager_transformer, txt_ids, [ids[row] for row in rows],
                          layout.longest)

    @contextlib.contextmanager
    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> Iterator[FluxBlocks]:
        embedded, txt_ids, timestep = self._call_inputs(latents, timesteps, embeds, guidance)
        model = self.eager_transformer

        def blocks(rotary: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None = None) -> FluxBlocks:
            return FluxBlocks(model, hidden_states=latents, encoder_hidden_states=embeds,
                              pooled_projections=pooled, timestep=timestep, guidance=embedded,
                              rotary=rotary, attention_mask=mask)

        if layout.uniform:
            ids = torch.cat((txt_ids, self.row_ids(layout.sizes[0], layout.cond_of(0))))
            yield blocks(model.pos_embed(ids))
            return
        from diffrt.engine.pipelines.flux.mixed import rows_processor

        with rows_processor(model):
            yield blocks(self._row_rotary(txt_ids, layout),
                         layout.key_mask(embeds.shape[1], latents.device))

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' own forward over rows of one size; under the sequence
        split this rank's image tokens and their position ids (the text whole)."""
        embedded, txt_ids, timestep = self._call_inputs(latents, timesteps, embeds, guidance)
        img_ids = self.row_ids(layout.sizes[0], layout.cond_of(0))
        sequence = self.sequence_split
        if sequence is not None:  # begun by the call layer; a no-op when it runs whole
            latents, img_ids = sequence.shard(latents, 1), sequence.shard(img_ids, 0)
        return self.denoiser(layout)(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=embedded,
            return_dict=False,
        )[0]

    def _rows_inputs(self, latents: torch.Tensor, timesteps: torch.Tensor,
                     embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                     layout: RowLayout) -> dict[str, Any]:
        """A call over rows of several sizes: its model and inputs, with a
        rotary table per row."""
        embedded, txt_ids, timestep = self._call_inputs(latents, timesteps, embeds, guidance)
        return {"model": self.denoiser(layout), "hidden_states": latents,
                "encoder_hidden_states": embeds, "pooled_projections": pooled,
                "timestep": timestep, "guidance": embedded,
                "rotary": self._row_rotary(txt_ids, layout)}

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """Rows of several sizes: a rotary table per row, padding masked (``mixed.py``)."""
        from diffrt.engine.pipelines.flux.mixed import forward_rows

        return forward_rows(**self._rows_inputs(latents, timesteps, embeds, pooled, guidance,
                                                layout),
                            attention_mask=layout.key_mask(embeds.shape[1], latents.device))

    packs_rows = True

    def packed_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """Rows of several sizes packed into one sequence (``packed.py``)."""
        from diffrt.engine.pipelines.flux.packed import forward_packed

        return forward_packed(**self._rows_inputs(latents, timesteps, embeds, pooled, guidance,
                                                  layout), layout=layout)

    def sequence_hooks(self, split: SequenceSplit) -> None:
        """Attention over the sequence group (``pipelines.flux.parallel``);
        the tokens are sharded in ``transformer_forward``, the output
        gathered by the call layer."""
        from diffrt.engine.pipelines.flux.parallel import SequenceParallelFluxAttnProcessor

        self.transformer.set_attn_processor(SequenceParallelFluxAttnProcessor(split))


__all__ = ["FluxPipeline", "calculate_shift"]
