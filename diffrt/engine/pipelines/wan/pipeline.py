"""The Wan pipeline: diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline``
on the shared denoise loop.

The family's five parts (docs/families.md): prompts through diffusers' own
``encode_prompt`` (UMT5, padded to 512 tokens); the transformer call over
``WanTransformer3DModel`` — Wan 2.2's two experts, ``transformer`` for
rows whose timestep is at or above the folder's boundary (``boundary_ratio``
x the train timesteps) and ``transformer_2`` below it, as diffusers switches
them, each row by its own timestep (requests at different steps share a
call); video latents as frames x patch tokens (``latents.py``); the decode
through ``AutoencoderKLWan`` with Wan's per-channel ``latents_mean`` /
``latents_std``.

Image-to-video (Wan 2.2 A14B's layout: no CLIP image encoder): the first
frame, followed by empty frames, is encoded as a clip (``condition_on_images``,
as diffusers' ``prepare_latents``: the distribution's mode, normalised) and
given to the transformer beside the noise as 4 mask and 16 latent channels;
the loop carries those per-row tokens as the rows' second text output
(``Conditioning.extra``), which t2v leaves empty.

Rows of different sizes or frame counts share a step as the engine's
``mixed_rows`` says: one padded call with a 3-D rotary table per row where
diffusers builds one per batch (``rows.py``; ``packed`` runs as padded),
or a call per size (``by_size``, the CPU default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.pipelines.wan.blocks import WanBlocks
from diffrt.engine.pipelines.wan.latents import TEXT_TOKENS, VideoLatents, patchify
from diffrt.engine.pipelines.wan.rows import VideoRows, rows_processors
from diffrt.engine.sampling import SamplingParams, filled

if TYPE_CHECKING:
    import torch.distributed as dist

    from diffrt.engine.parallel.sequence import SequenceSplit
    from diffrt.engine.parallel.vae import Bands


def text_window(tokenizer: Any) -> int:
    """What prompts are padded to: 512 (WanPipeline's ``max_sequence_length``
    default), or the tokenizer's ``model_max_length`` where it is shorter —
    the padding's keys take part in the cross-attention, so a model trained
    on 16 (``diffrt-motion``, a Helios: its pipeline is this one's) must not
    be given 512. diffusers pads to 512
    unless told; such a folder's card says ``max_sequence_length``."""
    return min(TEXT_TOKENS, int(tokenizer.model_max_length))


class WanPipeline(FlowMatchPipeline):
    """Text- and image-to-video with diffusers' ``WanTransformer3DModel``."""

    latents: VideoLatents
    #: Wan 2.2's low-noise expert (None: one transformer, Wan 2.1)
    transformer_2: Any = None
    #: the timestep at and above which ``transformer`` runs (None: always)
    boundary: float | None = None

    # -- encoders ------------------------------------------------------------------------
    @staticmethod
    def encode_with_diffusers(pipeline: Any, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """UMT5's last hidden states, zeroed past each prompt's tokens and
        padded to ``text_window`` (512), as WanPipeline encodes them; no
        second output (an empty (N, 0) tensor)."""
        embeds, _ = pipeline.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                           max_sequence_length=text_window(pipeline.tokenizer),
                                           device=device)
        return embeds, embeds.new_zeros(len(prompts), 0)

    @staticmethod
    def prompt_windows(pipeline: Any) -> list[PromptWindow]:
        return [PromptWindow("text_encoder", pipeline.tokenizer, text_window(pipeline.tokenizer))]

    def take_components(self, pipeline: Any) -> None:
        """Wan 2.2's second expert and its boundary, from the loaded folder."""
        from diffrt.engine.pipelines.components import place

        ratio = pipeline.config.get("boundary_ratio")
        if pipeline.transformer_2 is not None and ratio is not None:
            self.transformer_2 = place(pipeline.transformer_2, self.device)
            self.boundary = float(ratio) * self.noise_scheduler.config.num_train_timesteps

    def quantize_weights(self, method: str, text_method: str = "none") -> None:
        """Both experts' weights to ``method`` (the base class converts
        ``transformer`` only)."""
        from diffrt.engine.weights.quantize import quantize_module

        super().quantize_weights(method, text_method)
        if self.transformer_2 is not None:
            quantize_module(self.transformer_2, method, self.dtype)

    def weight_modules(self) -> dict[str, torch.nn.Module]:
        """Both experts (model offload moves each alone: one on the device
        at a time), the VAE, the text encoder."""
        modules = super().weight_modules()
        if self.transformer_2 is not None:
            modules["transformer_2"] = self.transformer_2
        return modules

    def offload_blocks(self) -> list[torch.nn.Module]:
        """Layer-wise offload streams both experts' blocks through the same
        device slots: a step runs one expert's blocks (or each in turn), so
        the device holds slots for ``prefetch + 1`` blocks of either."""
        from diffrt.engine.weights.offload import transformer_blocks

        blocks = super().offload_blocks()
        if self.transformer_2 is not None:
            blocks += transformer_blocks(self.transformer_2)
        return blocks

    def enable_loras(self, slots: int) -> dict[str, tuple[int, int]]:
        """Adapter slots over both experts' linears, the second's named
        ``transformer_2.<name>`` (``engine.lora.adapter_file`` reads a Wan 2.2
        adapter's two files into them)."""
        from diffrt.engine.lora.row_lora import RowLoras

        others = {} if self.transformer_2 is None else {"transformer_2": self.transformer_2}
        self.row_loras = RowLoras(self.transformer, slots, device=self.device, dtype=self.dtype,
                                  others=others)
        return self.row_loras.shapes()

    # -- latent layout -----------------------------------------------------------------
    def latent_layout(self, vae_config: dict[str, Any]) -> VideoLatents:
        patch = tuple(int(p) for p in self.transformer.config.patch_size)
        assert len(patch) == 3
        return VideoLatents(int(vae_config["z_dim"]), int(vae_config.get("scale_factor_spatial", 8)),
                            int(vae_config.get("scale_factor_temporal", 4)),
                            (patch[0], patch[1], patch[2]))

    # -- transformer call --------------------------------------------------------------
    def video_rows(self, latents: torch.Tensor, extra: torch.Tensor, layout: RowLayout,
                   expert: Any = None) -> VideoRows:
        """The rows' transformer input, each row at its own size, an
        image-to-video row's condition channels (``extra``) beside its
        latents, and their rotary table (``rows.py``: by ``expert``'s rope,
        the experts' tables being the same; default ``transformer``'s)."""
        rope = (expert if expert is not None else self.eager_transformer).rope
        return VideoRows.of(latents, extra, layout, self.latents, rope)

    def expert_rows(self, timesteps: torch.Tensor, high: Any
                    ) -> list[tuple[Any, torch.Tensor | None]]:
        """Each expert with the rows its timestep falls to (None: every row),
        ``high`` the high-noise expert (``transformer``, or its eager modules)."""
        if self.boundary is None:
            return [(high, None)]
        above = timesteps >= self.boundary
        out: list[tuple[Any, torch.Tensor | None]] = []
        for expert, rows in ((high, above), (self.transformer_2, ~above)):
            if bool(rows.all()):
                return [(expert, None)]
            if bool(rows.any()):
                out.append((expert, rows.nonzero().squeeze(1)))
        return out

    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """diffusers' forward over rows of one size, each row to the expert
        its timestep falls to (``expert_rows``)."""
        (x, _), = self.video_rows(latents, extra, layout).groups
        out: torch.Tensor | None = None
        for expert, index in self.expert_rows(timesteps, self.denoiser(layout)):
            if index is None:
                pred = expert(hidden_states=x, timestep=timesteps, encoder_hidden_states=embeds,
                              return_dict=False)[0]
                return self.latents.pack(pred)
            with self.lora_subset(index):
                pred = expert(hidden_states=x[index], timestep=timesteps[index],
                              encoder_hidden_states=embeds[index], return_dict=False)[0]
            if out is None:
                out = pred.new_empty(len(timesteps), *pred.shape[1:])
            out[index] = pred
        assert out is not None  # a call has rows
        return self.latents.pack(out)

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """Rows of several sizes in one call: a rotary table per row, the
        padding masked (``rows.py``), every block over every row."""
        with self.transformer_blocks(latents, timesteps, embeds, extra, guidance,
                                     layout) as blocks:
            return blocks.run_all()

    def lora_subset(self, rows: torch.Tensor | None) -> contextlib.AbstractContextManager:
        """The rows' adapters narrowed to an expert's ``rows`` of the call
        (an adapter's layers of ``transformer_2`` are its second file's:
        ``enable_loras``)."""
        if self.row_loras is None:
            return contextlib.nullcontext()
        return self.row_loras.subset(rows)

    @contextlib.contextmanager
    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> Iterator[WanBlocks]:
        """``transformer_forward``'s call cut at its blocks (``blocks.py``),
        over rows of one size or, padded, of several (``rows.py``)."""
        experts = self.expert_rows(timesteps, self.eager_transformer)
        video = self.video_rows(latents, extra, layout, experts[0][0])
        with rows_processors([model for model, _ in experts], video.padded):
            yield WanBlocks(experts, video, timesteps, embeds, self.lora_subset)

    # -- parallelism -------------------------------------------------------------------
    def sequence_hooks(self, split: SequenceSplit) -> None:
        """Each expert's video tokens split over the sequence group
        (``wan/parallel.py``); the call layer begins and ends each split."""
        from diffrt.engine.pipelines.wan.parallel import shard_experts

        second = [] if self.transformer_2 is None else [self.transformer_2]
        shard_experts([self.eager_transformer, *second], split)

    def band_decoder(self, group: dist.ProcessGroup | None) -> Bands:
        """``AutoencoderKLWan``'s decoder in bands of every frame's rows
        (``parallel.video_vae``)."""
        from diffrt.engine.parallel.video_vae import convert_video_decoder

        return convert_video_decoder(self.vae.decoder, group)

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, C, F, h, w) VAE latents -> frames: in bands over the ranks under
        ``vae_parallel``, else diffusers' decode (tiled under ``vae_tiling``)."""
        if self.vae_bands is not None:
            from diffrt.engine.parallel.vae import parallel_decode

            return parallel_decode(self.vae, latents, self.vae_bands)
        return self.vae.decode(latents, return_dict=False)[0]

    # -- image-to-video ----------------------------------------------------------------
    def encode_image_dist(self, pixels: torch.Tensor) -> Any:
        """The first frame's pixels as they are: Wan encodes it with the
        clip's empty frames (its VAE is causal in time), which needs the
        request's frame count (``condition_on_images``)."""
        return SimpleNamespace(mean=pixels, std=torch.zeros_like(pixels))

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """The first frame ((1, 3, H, W) in [-1, 1]) -> the rows' condition
        channels, as WanImageToVideoPipeline's ``prepare_latents`` makes them:
        the frame then zeros for the rest of the clip, encoded (the mode),
        normalised; before them a 4-channel mask, 1 on the first frame."""
        params = state.request.sampling_params
        frames = filled(params.num_frames)
        image = image_latents[0].to(self.device, self.dtype)[:, :, None]
        clip = torch.cat([image, image.new_zeros(*image.shape[:2], frames - 1,
                                                 *image.shape[3:])], dim=2)
        latent = self.vae.encode(clip, return_dict=False)[0].mode()
        mean, inv_std = self.latent_stats(latent)
        latent = (latent - mean) * inv_std
        t = self.latents.temporal
        f, h, w = self.latents.size(params)
        mask = torch.ones(1, 1, frames, h, w, device=latent.device, dtype=latent.dtype)
        mask[:, :, 1:] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, t, h, w).transpose(1, 2)
        condition = torch.cat([mask, latent], dim=1)
        assert condition.shape[2] == f  # one mask group per latent frame
        n = params.num_outputs_per_prompt
        tokens = patchify(condition, self.latents.patch).repeat(n, 1, 1)
        cond = state.cond
        assert cond is not None  # prepared before its images
        state.cond = Conditioning(cond.embeds, tokens, cond.neg_embeds,
                                  None if cond.neg_embeds is None else tokens)

    # -- decode ------------------------------------------------------------------------
    def latent_stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel ``latents_mean`` and 1 / ``latents_std``,
        (1, C, 1, 1, 1), as diffusers' Wan pipelines compute them."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device,
                                                                         latents.dtype)
        return mean, inv_std

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Tokens -> frames in [-1, 1], (N, 3, frames, H, W)."""
        spatial = self.latents.unpack(latents, self.latents.size(params)).to(self.dtype)
        mean, inv_std = self.latent_stats(spatial)
        video = self.decode_video(spatial / inv_std + mean)
        return video.clamp(-1, 1)


__all__ = ["WanPipeline", "text_window"]
