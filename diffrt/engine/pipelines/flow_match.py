"""The flow-matching pipelines' base: a family's hooks over one denoise loop.

``FlowMatchPipeline`` is what a family (Flux, SD3, Qwen-Image) subclasses.
It wires three parts with one job each — the components and their set-up
(``components.py``), the conditioning stages (``conditioning.py``) and the
denoise loop for both execution modes (``denoise.py``), whose transformer
call is the family's wrapped in the feature layers of
``transformer_call.py`` — and gives the family contract's defaults
(``contract.py``; docs/families.md): a family supplies its spec, its
encoders, its transformer call, its latent layout and its decode.

Both execution modes run the same stages, so a request gives the same image
whether it runs as a whole (``forward``) or one step at a time
(``prepare_encode`` -> ``denoise_step`` / ``apply_step`` ... -> ``post_decode``).
"""

from __future__ import annotations

import copy
import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.cache.forward import TransformerBlocks
from diffrt.engine.input_images import InputPixels
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.models.folder_check import ModelLoadError
from diffrt.engine.outputs import CacheMetrics
from diffrt.engine.pipelines.components import ComponentsPipeline, place
from diffrt.engine.pipelines.conditioning import (
    Conditioner,
    binarized,
    resolve_seed,
    to_model_pixels,
)
from diffrt.engine.pipelines.denoise import DenoiseLoop
from diffrt.engine.pipelines.flow_match_spec import vae_factor
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.interface import (
    DiffusionRequestBatch,
    RequestOutput,
    StepRequestState,
)
from diffrt.engine.pipelines.latents import SpatialLatents
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.pipelines.transformer_call import RowsCall, TransformerCall, build_call
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams, filled

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, ModelMixin, SchedulerMixin
    from diffusers import DiffusionPipeline as DiffusersPipeline
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from diffrt.engine.cache.state import RequestCache
    from diffrt.engine.pipelines.prompt_cache import TextEncoder

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")


class FlowMatchPipeline(ComponentsPipeline):
    """Common base of the flow-matching families (flow matching + a VAE)."""

    #: the family's text encoder reads an edit's input image with its prompt
    #: (Qwen-Image-Edit's Qwen2.5-VL): those prompts are encoded with their
    #: image, one request at a time, past the prompt cache (it keys by text)
    text_sees_images = False

    def __init__(self, transformer: ModelMixin, vae: AutoencoderKL | AutoencoderKLQwenImage,
                 noise_scheduler: SchedulerMixin, text_encoder: TextEncoder, *,
                 device: torch.device = CPU, dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = place(transformer, self.device)
        self.vae = place(vae, self.device)
        # The diffusers noise scheduler, as a template only: its step() mutates
        # internal state, so every request steps its own deep copy of it.
        self.noise_scheduler = noise_scheduler
        self.text_encoder = text_encoder
        vae_config = dict(vae.config)
        self.latents: SpatialLatents = self.latent_layout(vae_config)
        self.vae_scale_factor = self.latents.factor
        self.latent_channels = self.latents.channels
        scaling = getattr(vae.config, "scaling_factor", None)
        self.scaling_factor = float(scaling) if scaling is not None else 1.0
        shift = getattr(vae.config, "shift_factor", None)
        self.shift_factor = float(shift) if shift is not None else 0.0
        self.conditioner = Conditioner(self)
        self.loop = DenoiseLoop(self, self.conditioner)
        #: the family's call inside the feature layers (``transformer_call``)
        self.call: TransformerCall = build_call(self)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def load(cls, spec: ModelSpec, *, device: torch.device,
             dtype: torch.dtype) -> FlowMatchPipeline:
        """Load ``spec.folder``, a local diffusers folder (nothing is downloaded).

        The folder is loaded whole by the family's own diffusers pipeline
        class (``loading.py``: component by component, with progress), and its
        prompts are encoded by that pipeline's ``encode_prompt``
        (``folder_text.py``), so the conditioning is what diffusers gives.
        """
        from diffrt.engine.models.loading import load_diffusers_pipeline
        from diffrt.engine.pipelines.folder_text import FolderTextEncoder

        if spec.folder is None or spec.diffusers_pipeline is None:
            raise ModelLoadError(f"{spec.name}: a {cls.__name__} loads a diffusers folder; "
                                 "its spec names none")
        device = torch.device(device)
        full = load_diffusers_pipeline(spec.folder, spec.diffusers_pipeline, dtype=dtype,
                                       preloaded=cls.preloaded_components(spec.folder))
        for name, module in full.components.items():
            if name.startswith("text_encoder") and module is not None:
                place(module, device)
        text = FolderTextEncoder(full, cls.encode_with_diffusers, device=device,
                                 windows=cls.prompt_windows(full))
        pipeline = cls(full.transformer, full.vae, full.scheduler, text, device=device,
                       dtype=dtype)
        pipeline.spec = spec
        pipeline.take_components(full)
        return pipeline

    def take_components(self, pipeline: Any) -> None:
        """Components of the loaded diffusers ``pipeline`` beyond the
        transformer, VAE and text encoders the family keeps (none by
        default; Wan 2.2's second expert)."""

    # -- the family's: encoders ----------------------------------------------------------
    @staticmethod
    def preloaded_components(folder: str) -> dict[str, Any]:
        """Components of ``folder`` the family loads itself, before diffusers
        loads the rest (none by default)."""
        return {}

    @staticmethod
    def encode_with_diffusers(pipeline: DiffusersPipeline, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's diffusers ``encode_prompt`` with its inputs on ``device``
        (the compute device, wherever the encoders' weights are between
        uses): (embeds, extra) per prompt."""
        raise NotImplementedError

    @staticmethod
    def prompt_windows(pipeline: DiffusersPipeline) -> list[PromptWindow]:
        """The family's text encoders and where each cuts a prompt, as its
        ``encode_with_diffusers`` calls them (what ``take_prompt_cuts`` counts)."""
        return []

    def encode_with_images(self, request: DiffusionRequest, inputs: InputPixels) -> Conditioning:
        """An edit's prompt (and negative) conditioned on its input images
        (uint8 (H, W, 3), as resized): the family's, where its text encoder sees images."""
        raise NotImplementedError(f"{self.name}'s text encoder reads no images")

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """An edit: give the request its input images' (1, C, h, w) latents as
        conditioning (the family's way: extra tokens for FLUX.1 Kontext and
        Qwen-Image-Edit, ``StepRequestState.edit``)."""
        raise NotImplementedError(f"{self.name} does not edit images")

    # -- the family's: latent layout and schedule ------------------------------------------
    def latent_layout(self, vae_config: dict[str, Any]) -> SpatialLatents:
        """The family's latents for its VAE (``latents.LatentLayout``): by
        default one token a latent of an AutoencoderKL."""
        return SpatialLatents(int(vae_config["latent_channels"]), vae_factor(vae_config))

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        """Extra arguments to the noise scheduler's set_timesteps (sigmas, mu)."""
        return {}

    def prepare_timesteps(self, params: SamplingParams
                          ) -> tuple[SchedulerMixin, torch.Tensor]:
        """A fresh noise-scheduler copy with its timesteps set, and those
        timesteps; never the shared template."""
        noise_scheduler = copy.deepcopy(self.noise_scheduler)
        steps = filled(params.num_inference_steps)
        noise_scheduler.set_timesteps(steps, device=self.device,
                                      **self.timestep_kwargs(steps, params))
        return noise_scheduler, noise_scheduler.timesteps

    def row_layout(self, params: SamplingParams, rows: int | None = None,
                   loras: tuple[tuple[int, float], ...] = (),
                   cond: tuple[tuple[int, int], ...] = (),
                   cache: RequestCache | None = None) -> RowLayout:
        """The layout of ``rows`` rows (default: one per output) of one
        request, each with the request's LoRA adapters ``loras``, its
        conditioning images' latent sizes ``cond`` (an edit) and its step
        cache ``cache``."""
        size = self.latents.size(params)
        tokens = self.latents.tokens(size) + sum(self.latents.tokens(c) for c in cond)
        return RowLayout.uniform_rows(size, tokens,
                                      params.num_outputs_per_prompt if rows is None else rows,
                                      loras, cond, cache)

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, C, h, w) VAE latents -> the transformer's layout."""
        return self.latents.pack(latents)

    def prepare_latents(self, params: SamplingParams, seed: int) -> torch.Tensor:
        """Initial noise from the request's own CPU generator, packed."""
        return self.loop.first_latents(params, seed)

    # -- the family's: transformer call --------------------------------------------------
    def transformer_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """One transformer call over rows of one size (rows of several go to
        ``padded_forward`` / ``packed_forward``); ``timesteps`` and
        ``guidance`` are per row; the model is ``denoiser(layout)``. Under
        the sequence split the call has begun it: the family's hooks
        (``sequence_hooks``) shard its tokens."""
        raise NotImplementedError

    #: the family has a ``packed_forward`` (``mixed_rows="packed"``)
    packs_rows = False

    def padded_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """One call over rows of several sizes, each zero-padded to the
        longest and its padding masked (``segments``): the family's where
        its spec mixes sizes (``ModelSpec.mixed_sizes``)."""
        raise NotImplementedError(f"{self.name} takes no rows of several sizes in one call")

    def packed_forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                       embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                       layout: RowLayout) -> torch.Tensor:
        """``padded_forward``'s call with every row's tokens in one sequence,
        nothing padded (``packs_rows``); inputs and output padded as there."""
        raise NotImplementedError(f"{self.name} packs no rows")

    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> AbstractContextManager[TransformerBlocks]:
        """``transformer_forward``'s call cut at its blocks, while held
        (``engine.cache.forward``): the family's."""
        raise NotImplementedError(f"{self.name} cuts no transformer call at its blocks")

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance per row: ``uncond + s * (cond - uncond)``."""
        g = scale.view(-1, *([1] * (cond.dim() - 1))).to(cond.dtype)
        return uncond + g * (cond - uncond)

    def run_transformer(self, latents: torch.Tensor, timesteps: torch.Tensor,
                        embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                        layout: RowLayout) -> torch.Tensor:
        """The call the loop makes: the family's inside the feature layers."""
        return self.call(RowsCall(latents, timesteps, embeds, extra, guidance, layout))

    # -- the family's: decode (and encode, for input images) -------------------------------
    def encode_image_dist(self, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        """The VAE's latent distribution of ``pixels`` ((B, 3, H, W) in [-1, 1]);
        its ``mean`` and ``std`` are what diffusers samples from."""
        return self.vae.encode(pixels, return_dict=False)[0]

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Sampled VAE latents -> the denoiser's latent space (as the family's
        diffusers ``_encode_vae_image``): shift, then scale."""
        return (latents - self.shift_factor) * self.scaling_factor

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Transformer-layout latents -> images in [-1, 1], (N, 3, H, W), on the device."""
        spatial = self.latents.unpack(latents, self.latents.size(params))
        spatial = spatial / self.scaling_factor + self.shift_factor
        if self.vae_bands is not None:  # each rank its band of rows, then gathered
            from diffrt.engine.parallel.vae import parallel_decode

            images = parallel_decode(self.vae, spatial.to(self.dtype), self.vae_bands)
        else:
            images = self.vae.decode(spatial.to(self.dtype), return_dict=False)[0]
        return images.clamp(-1, 1)

    # -- the runner's: both execution modes (``denoise.DenoiseLoop``) -----------------------
    @torch.no_grad()
    def forward(self, batch: DiffusionRequestBatch) -> list[RequestOutput]:
        return self.loop.forward(batch)

    @torch.no_grad()
    def prepare_encode(self, state: StepRequestState) -> None:
        self.prepare_encode_batch([state])

    @torch.no_grad()
    def prepare_encode_batch(self, states: list[StepRequestState]) -> None:
        """``prepare_encode`` for the requests admitted in one tick, their
        prompts encoded in one text-encoder call and their input images in
        one VAE call per size."""
        self.loop.prepare_encode_batch(states)

    @torch.no_grad()
    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor:
        return self.loop.denoise_step(states)

    def split_predictions(self, noise_pred: torch.Tensor,
                          states: list[StepRequestState]) -> list[torch.Tensor]:
        return self.loop.split_predictions(noise_pred, states)

    @torch.no_grad()
    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        self.loop.apply_step(state, noise_pred)

    @torch.no_grad()
    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        return self.loop.decode_preview(state)

    @torch.no_grad()
    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        return self.loop.post_decode(state)

    @torch.no_grad()
    def post_decode_batch(self, states: list[StepRequestState]) -> list[RequestOutput]:
        """One VAE decode for requests finishing in the same tick (as forward does)."""
        return self.loop.post_decode_batch(states, self.post_decode)

    def take_prompt_cuts(self) -> dict[str, dict[str, int]]:
        return self.conditioner.take_prompt_cuts()

    def take_cache_metrics(self) -> dict[str, CacheMetrics]:
        return self.loop.take_cache_metrics()


__all__ = ["FlowMatchPipeline", "binarized", "resolve_seed", "to_model_pixels"]
