"""Flux family: FluxTransformer2DModel on 2x2-packed latent tokens.

Only what is Flux-specific lives here: packing latents into tokens, the
image/text position ids, timesteps scaled to [0, 1] and Flux's resolution
dependent sigma shift (the tiny seeded folder behind `tiny-flux` is
``tiny_folder.py``'s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.flux.blocks import FluxBlocks
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.pipelines.request_state import EditTokens
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.sampling import SamplingParams


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Flux's resolution-dependent shift (mu), as in diffusers' FluxPipeline."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


class FluxPipeline(FlowMatchPipeline):
    """Text-to-image with a diffusers FluxTransformer2DModel."""

    @staticmethod
    def encode_with_diffusers(pipeline: Any, prompts: list[str],
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
    def prompt_windows(pipeline: Any) -> list[PromptWindow]:
        """CLIP at the pipeline's ``tokenizer_max_length`` (77), T5 at the
        length ``encode_with_diffusers`` asks."""
        length = min(512, int(getattr(pipeline.tokenizer_2, "model_max_length", 512)))
        return [PromptWindow("text_encoder", pipeline.tokenizer, pipeline.tokenizer_max_length),
                PromptWindow("text_encoder_2", pipeline.tokenizer_2, length)]

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        n, c, h, w = latents.shape
        latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return latents.reshape(n, (h // 2) * (w // 2), c * 4)

    def unpack_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        n, _, d = latents.shape
        h, w = self.latent_size(params)
        latents = latents.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return latents.reshape(n, d // 4, h, w)

    def image_tokens(self, size: tuple[int, int]) -> int:
        """2 x 2 latent patches a token."""
        return (size[0] // 2) * (size[1] // 2)

    def image_ids(self, size: tuple[int, int]) -> torch.Tensor:
        """Flux's (row, column) positions of the packed tokens of latents of ``size``."""
        h, w = (side // 2 for side in size)
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        # float32 whatever the model dtype: bf16 cannot count past 256 exactly
        return ids.reshape(h * w, 3).to(device=self.device)

    def row_ids(self, size: tuple[int, int], conds: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """A row's token positions: its image's, then (an edit) its input
        image's, whose first coordinate is 1 (FluxKontextPipeline's ids)."""
        parts = [self.image_ids(size)]
        for cond in conds:
            parts.append(self.image_ids(cond))
            parts[-1][:, 0] = 1
        return torch.cat(parts) if conds else parts[0]

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """An edit: the input images' packed latents follow the noise's tokens
        in every step, in order (``row_input``); only the noise's are
        predicted (FLUX.1 Kontext, and Qwen-Image-Edit, which packs alike)."""
        n = state.request.sampling_params.num_outputs_per_prompt
        packed = []
        for latents in image_latents:
            latents = torch.cat([latents] * n) if n > 1 else latents
            packed.append(self.pack_latents(latents.to(self.device, self.dtype)))
        state.edit = EditTokens(torch.cat(packed, dim=1),
                                tuple((int(x.shape[2]), int(x.shape[3])) for x in image_latents))

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        kwargs: dict[str, Any] = {"sigmas": sigmas}
        cfg = self.noise_scheduler.config
        if cfg.get("use_dynamic_shifting", False):
            h, w = self.latent_size(params)
            seq_len = (h // 2) * (w // 2)
            kwargs["mu"] = calculate_shift(
                seq_len,
                cfg.get("base_image_seq_len", 256),
                cfg.get("max_image_seq_len", 4096),
                cfg.get("base_shift", 0.5),
                cfg.get("max_shift", 1.15),
            )
        return kwargs

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
        kwargs: dict[str, Any] = {"hidden_states": latents, "encoder_hidden_states": embeds,
                  "pooled_projections": pooled, "timestep": timestep, "guidance": embedded}
        if layout.uniform:
            ids = torch.cat((txt_ids, self.row_ids(layout.sizes[0], layout.cond_of(0))))
            yield FluxBlocks(model, rotary=model.pos_embed(ids), **kwargs)
            return
        from diffrt.engine.pipelines.flux.mixed import rows_processor

        with rows_processor(model):
            yield FluxBlocks(model, rotary=self._row_rotary(txt_ids, layout),
                             attention_mask=layout.key_mask(embeds.shape[1], latents.device),
                             **kwargs)

    def transformer_forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        embeds: torch.Tensor,
        pooled: torch.Tensor,
        guidance: torch.Tensor,
        layout: RowLayout,
    ) -> torch.Tensor:
        embedded, txt_ids, timestep = self._call_inputs(latents, timesteps, embeds, guidance)
        if not layout.uniform:  # rows of several sizes: a rotary table per row
            from diffrt.engine.pipelines.flux.mixed import forward_rows

            rotary = self._row_rotary(txt_ids, layout)
            # adapters index rows, and an edit's tokens are not its own image's
            if self.mixed_rows == "packed" and not layout.loras and not layout.conds:
                from diffrt.engine.pipelines.flux.packed import forward_packed

                return forward_packed(
                    self.transformer, hidden_states=latents, layout=layout,
                    encoder_hidden_states=embeds, pooled_projections=pooled, timestep=timestep,
                    guidance=embedded, rotary=rotary)
            return forward_rows(
                self.transformer, hidden_states=latents, encoder_hidden_states=embeds,
                pooled_projections=pooled, timestep=timestep, guidance=embedded, rotary=rotary,
                attention_mask=layout.key_mask(embeds.shape[1], latents.device))  # type: ignore[arg-type]
        img_ids = self.row_ids(layout.sizes[0], layout.cond_of(0))
        sequence = self._sequence_split
        if sequence is not None and sequence.begin(latents.shape[1]):  # this rank's image tokens
            latents, img_ids = sequence.shard(latents, 1), sequence.shard(img_ids, 0)
            sequence.text_len = embeds.shape[1]
        out = self.transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=embedded,
            return_dict=False,
        )[0]
        return out if sequence is None else sequence.end(out, 1)

    _sequence_split = None

    def enable_sequence_parallel(self, groups: Any) -> None:
        """Each rank runs the transformer on its slice of the image tokens (and
        of their position ids; the text whole); attention goes over the
        sequence group (``pipelines.flux.parallel``); the output is
        gathered."""
        from diffrt.engine.parallel.sequence import SequenceSplit
        from diffrt.engine.pipelines.flux.parallel import SequenceParallelFluxAttnProcessor

        self._sequence_split = SequenceSplit(groups.sequence, groups.sequence_attention())
        self.transformer.set_attn_processor(SequenceParallelFluxAttnProcessor(
            self._sequence_split))
