"""Shared orchestration of the flow-matching text-to-image pipelines.

`FlowMatchPipeline` owns everything that does not depend on the transformer
family: prompt encoding, per-request latents, per-request timesteps and
noise-scheduler copies, classifier-free guidance, the denoise loop and VAE
decoding. A family (Flux, SD3) only says how latents are laid out for its
transformer (`pack_latents` / `unpack_latents`), how to call it
(`transformer_forward`) and which sigmas/shift its noise scheduler wants
(`timestep_kwargs`).

Both execution modes run the same helpers, so a request gives the same image
whether it runs as a whole (`forward`) or one step at a time
(`prepare_encode` -> `denoise_step` / `apply_step` ... -> `post_decode`).

Batch invariance: each request draws its latents from its own CPU generator
seeded by its seed, text embeddings have a fixed length, and guidance is
applied per row, so a request's image does not depend on its batch mates
(up to floating-point reassociation in batched matmuls).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from diffrt.engine.cache.forward import TransformerBlocks, cached_call
from diffrt.engine.cache.state import DEFAULT_CACHE_STATE_BYTES, CacheBudget, RequestCache
from diffrt.engine.input_images import InputPixels, read_pixels
from diffrt.engine.model_spec import ModelSpec, check_heads
from diffrt.engine.outputs import CacheMetrics, TextEncoderStats
from diffrt.engine.pipelines.flow_match_spec import vae_factor
from diffrt.engine.pipelines.folder_check import ModelLoadError
from diffrt.engine.pipelines.folder_text import PromptWindow
from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.pipelines.prompt_cache import CachedTextEncoder, cat_rows
from diffrt.engine.pipelines.request_state import Conditioning, Inpaint, Overlay
from diffrt.engine.pipelines.segments import RowLayout, pad_tokens
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams, filled, random_seed

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")
T = TypeVar("T")


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or a fresh random one when it gave none (the engine
    draws it at submission; a pipeline called directly may still get None)."""
    return random_seed() if seed is None else int(seed)


def to_model_pixels(image: torch.Tensor) -> torch.Tensor:
    """A (H, W, 3) uint8 image -> (1, 3, H, W) float32 in [-1, 1], with the
    float steps of diffusers' ``VaeImageProcessor`` (``/ 255``, then ``2x - 1``)."""
    x = image.to(torch.float32) / 255.0
    return (2.0 * x - 1.0).permute(2, 0, 1)[None].contiguous()


def binarized(mask: torch.Tensor) -> torch.Tensor:
    """A (H, W) uint8 mask as float 0 / 1, binarised at one half as diffusers'
    mask processor does (white: repaint)."""
    m = mask.to(torch.float32) / 255.0
    return (m >= 0.5).to(torch.float32)


def _check_compatible(requests: list[DiffusionRequest], key: Any) -> None:
    """Refuse a batch the engine should not have formed (a bug, not user input)."""
    first = key(requests[0])
    for other in requests[1:]:
        if key(other) != first:
            raise ValueError(
                f"incompatible requests in one batch: {key.__name__} {key(other)} != {first}"
            )


def _prepared(value: T | None) -> T:
    """A field ``prepare_encode`` set (a step of an unprepared state is a bug)."""
    assert value is not None, "a step of a request that was not prepared"
    return value


def _place(module: Any, device: torch.device) -> Any:
    """Move a loaded model to the device, in eval mode. Its dtype was set when it
    was loaded (``from_pretrained(dtype=...)``), which keeps the layers a model
    declares float32-only (T5's ``wo``) in float32; a later ``.to(dtype)``
    would cast those too and give other pixels than diffusers."""
    return module.to(device).eval()


class FlowMatchPipeline(DiffusionPipeline):
    """Common base of the Flux and SD3 pipelines (flow matching + AutoencoderKL)."""

    def __init__(
        self,
        transformer: Any,
        vae: Any,
        noise_scheduler: Any,
        text_encoder: Any,
        *,
        device: torch.device = CPU,
        dtype: torch.dtype = torch.float32,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = _place(transformer, self.device)
        self.vae = _place(vae, self.device)
        # The diffusers noise scheduler, as a template only: its step() mutates
        # internal state, so every request steps its own deep copy of it.
        self.noise_scheduler = noise_scheduler
        #: prompts -> (embeds, extra), one row per prompt (FolderTextEncoder).
        self.text_encoder = text_encoder
        #: request id -> text encoder -> tokens it cut, since ``take_prompt_cuts``
        self._prompt_cuts: dict[str, dict[str, int]] = {}
        #: request id -> its step cache's metrics, since ``take_cache_metrics``
        self._cache_metrics: dict[str, CacheMetrics] = {}
        self.vae_scale_factor = self.vae_factor(dict(vae.config))
        self.latent_channels = self.vae_latent_channels(dict(vae.config))
        scaling = getattr(vae.config, "scaling_factor", None)
        self.scaling_factor = float(scaling) if scaling is not None else 1.0
        shift = getattr(vae.config, "shift_factor", None)
        self.shift_factor = float(shift) if shift is not None else 0.0

    @staticmethod
    def vae_factor(vae_config: dict) -> int:
        """Pixels per latent of the family's VAE (diffusers' ``vae_scale_factor``)."""
        return vae_factor(vae_config)

    @staticmethod
    def vae_latent_channels(vae_config: dict) -> int:
        return int(vae_config["latent_channels"])

    # -- construction ---------------------------------------------------------
    @classmethod
    def load(cls, spec: ModelSpec, *, device: torch.device,
             dtype: torch.dtype) -> FlowMatchPipeline:
        """Load ``spec.folder``, a local diffusers folder (nothing is downloaded).

        The folder is loaded whole by the family's own diffusers pipeline
        class (``loading.py``: component by component, with progress), and its
        prompts are encoded by that pipeline's ``encode_prompt``
        (``folder_text.py``), so the conditioning is what diffusers gives.
        """
        from diffrt.engine.pipelines.folder_text import FolderTextEncoder
        from diffrt.engine.pipelines.loading import load_diffusers_pipeline

        if spec.folder is None or spec.diffusers_pipeline is None:
            raise ModelLoadError(f"{spec.name}: a {cls.__name__} loads a diffusers folder; "
                                 "its spec names none")
        device = torch.device(device)
        full = load_diffusers_pipeline(spec.folder, spec.diffusers_pipeline, dtype=dtype,
                                       preloaded=cls.preloaded_components(spec.folder))
        for name, module in full.components.items():
            if name.startswith("text_encoder") and module is not None:
                _place(module, device)
        text = FolderTextEncoder(full, cls.encode_with_diffusers, device=device,
                                 windows=cls.prompt_windows(full))
        pipeline = cls(full.transformer, full.vae, full.scheduler, text, device=device,
                       dtype=dtype)
        pipeline.spec = spec
        return pipeline

    def compile_models(self, backend: str) -> None:
        """The transformer only: it is the denoising loop's whole cost on an
        accelerator. The VAE decoder stays eager (under ``aot_eager`` its
        group norms meet non-contiguous inputs and fail; on CPU inductor
        gained nothing on it)."""
        import torch._dynamo

        # dynamic=None: the first shape compiles static; a shape that changes
        # later (batch size, image size) is recompiled once with that dimension
        # dynamic, instead of once per value
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.transformer = torch.compile(self.transformer, backend=backend, dynamic=None)

    def configure_memory(self, *, vae_tiling: bool = False,
                         vae_slicing: bool = False) -> None:
        if vae_tiling:
            self.vae.enable_tiling()  # diffusers blends overlapping tiles
        if vae_slicing:
            self.vae.enable_slicing()

    # -- weights (``engine.weights``) ------------------------------------------------------
    def weight_modules(self) -> dict[str, torch.nn.Module]:
        """Component name -> its module: the transformer, the VAE and each
        text encoder (``text_encoder``, ``text_encoder_2``, ...)."""
        encoder = getattr(self.text_encoder, "encoder", self.text_encoder)  # under the cache
        components = getattr(getattr(encoder, "pipeline", None), "components", {})
        texts = {name: module for name, module in components.items()
                 if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)}
        return {"transformer": self.eager_transformer, "vae": self.vae, **texts}

    def quantize_weights(self, method: str, text_method: str = "none") -> None:
        """The transformer's weights to ``method``, the text encoders' to
        ``text_method`` (``engine.weights.quantize``); before LoRA, parallel
        and compile hooks, which then see the quantised modules."""
        from diffrt.engine.weights.quantize import quantize_module

        for name, module in self.weight_modules().items():
            chosen = method if name == "transformer" else (
                text_method if name.startswith("text_encoder") else "none")
            quantize_module(module, chosen, self.dtype)

    def enable_layerwise_offload(self, platform: Any, prefetch: int = 1, *,
                                 device: torch.device | None = None) -> Any:
        """The transformer's blocks to host memory, streamed to ``device``
        (default: the pipeline's) per call (``engine.weights.offload``)."""
        from diffrt.engine.weights.offload import LayerwiseOffload, transformer_blocks

        self.offload = LayerwiseOffload(transformer_blocks(self.eager_transformer), platform,
                                        device or self.device, prefetch=prefetch)
        return self.offload

    def enable_model_offload(self, platform: Any, kept: tuple[str, ...] = (), *,
                             device: torch.device | None = None) -> Any:
        """Whole components to host memory, each moved to ``device`` (default:
        the pipeline's) when it runs (``engine.weights.model_offload``)."""
        from diffrt.engine.weights.model_offload import ModelOffload

        self.model_offload = ModelOffload(self.weight_modules(), platform,
                                          device or self.device, kept=kept)
        return self.model_offload

    def place_weights(self, device: torch.device, *, on_host: tuple[str, ...] = ()) -> None:
        """Move the components not in ``on_host`` to ``device`` and compute
        there; under layer-wise offload the transformer's blocks stay in their
        host buffers and only the rest of it moves."""
        self.device = self.text_encoder.device = torch.device(device)
        offload = getattr(self, "offload", None)
        for name, module in self.weight_modules().items():
            if name in on_host:
                continue
            if name == "transformer" and offload is not None:
                offload.place_rest(module, self.device)
            else:
                _place(module, self.device)

    def enable_parallel(self, groups: Any, *, vae_parallel: bool = False) -> None:
        """CFG branches over ``groups.cfg``, image tokens over
        ``groups.sequence`` (the family's ``enable_sequence_parallel``), the
        VAE decode in bands over all ranks (``engine.parallel.vae``)."""
        self.spec.check_parallel(groups.degrees, vae_parallel)
        check_heads(getattr(self.transformer.config, "num_attention_heads", None),
                     groups.degrees.ulysses)  # the loaded model's, whatever the class said
        self.cfg_parallel_group = groups.cfg
        if groups.sequence is not None:
            self.enable_sequence_parallel(groups)
        if vae_parallel:
            from diffrt.engine.parallel.vae import convert_decoder

            self._vae_bands = convert_decoder(self.vae.decoder, groups.all_ranks)

    def enable_sequence_parallel(self, groups: Any) -> None:
        """Split each transformer call's image tokens over ``groups.sequence``."""
        raise NotImplementedError(f"{self.name} has no sequence parallelism")

    _vae_bands: Any = None

    def enable_prompt_cache(self, max_bytes: int, *,
                            synchronize: Callable[[], None] | None = None) -> None:
        if not isinstance(self.text_encoder, CachedTextEncoder):
            self.text_encoder = CachedTextEncoder(self.text_encoder, max_bytes, synchronize)

    def text_encoder_stats(self) -> TextEncoderStats | None:
        if isinstance(self.text_encoder, CachedTextEncoder):
            return self.text_encoder.stats()
        return None

    @staticmethod
    def preloaded_components(folder: str) -> dict[str, Any]:
        """Components of ``folder`` the family loads itself, before diffusers
        loads the rest (none by default)."""
        return {}

    @staticmethod
    def encode_with_diffusers(pipeline: Any, prompts: list[str],
                              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's diffusers ``encode_prompt`` with its inputs on ``device``
        (the compute device, wherever the encoders' weights are between
        uses): (embeds, extra) per prompt."""
        raise NotImplementedError

    @staticmethod
    def prompt_windows(pipeline: Any) -> list[PromptWindow]:
        """The family's text encoders and where each cuts a prompt, as its
        ``encode_with_diffusers`` calls them (what ``take_prompt_cuts`` counts)."""
        return []

    def take_prompt_cuts(self) -> dict[str, dict[str, int]]:
        cuts, self._prompt_cuts = self._prompt_cuts, {}
        return cuts

    # -- family hooks -----------------------------------------------------------
    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, C, h, w) VAE latents -> the transformer's layout."""
        return latents

    def unpack_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The transformer's layout -> (N, C, h, w) VAE latents."""
        return latents

    def timestep_kwargs(self, num_steps: int, params: SamplingParams) -> dict[str, Any]:
        """Extra arguments to the noise scheduler's set_timesteps (sigmas, mu)."""
        return {}

    def transformer_forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        embeds: torch.Tensor,
        extra: torch.Tensor,
        guidance: torch.Tensor,
        layout: RowLayout,
    ) -> torch.Tensor:
        """One transformer call over rows; `timesteps` and `guidance` are per
        row, ``layout`` says each row's image size. A family that takes rows
        of different sizes in one call (``ModelSpec.mixed_sizes``) gets them
        zero-padded to the longest row (``segments``)."""
        raise NotImplementedError

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The transformer's image tokens for latents of ``size`` (h, w)."""
        h, w = size
        return h * w

    def row_layout(self, params: SamplingParams, rows: int | None = None,
                   loras: tuple[tuple[int, float], ...] = (),
                   cond: tuple[tuple[int, int], ...] = (), cache: Any = None) -> RowLayout:
        """The layout of ``rows`` rows (default: one per output) of one
        request, each with the request's LoRA adapters ``loras``, its
        conditioning images' latent sizes ``cond`` (an edit) and its step
        cache ``cache``."""
        size = self.latent_size(params)
        tokens = self.image_tokens(size) + sum(self.image_tokens(c) for c in cond)
        return RowLayout.uniform_rows(size, tokens,
                                      params.num_outputs_per_prompt if rows is None else rows,
                                      loras, cond, cache)

    # -- step caches (``engine.cache``) -----------------------------------------------
    @property
    def eager_transformer(self) -> Any:
        """The transformer's own modules (under a ``torch.compile`` wrapper)."""
        return getattr(self.transformer, "_orig_mod", self.transformer)

    @property
    def caches_here(self) -> bool:
        """Step caches run on this worker: one rank holds each request's rows
        whole (a CFG-parallel or sequence-parallel split would need every
        rank to agree on each decision; the engine refuses such requests)."""
        return self.cfg_parallel_group is None and getattr(self, "_sequence_split", None) is None

    def new_cache(self, state: StepRequestState) -> RequestCache | None:
        """The step cache a prepared request runs with (None: none)."""
        plan = self.spec.cache_plan(state.request.sampling_params)
        if plan is None or not self.caches_here:
            return None
        if self.cache_budget is None:
            self.cache_budget = CacheBudget(DEFAULT_CACHE_STATE_BYTES)
        return RequestCache(plan, state.total_steps, self.cache_budget, state.request_id)

    @staticmethod
    def _running_cache(state: StepRequestState) -> RequestCache | None:
        cache = state.cache
        return cache if cache is not None and cache.active else None

    def transformer_blocks(self, latents: torch.Tensor, timesteps: torch.Tensor,
                           embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                           layout: RowLayout) -> AbstractContextManager[TransformerBlocks]:
        """``transformer_forward``'s call cut at its blocks, while held
        (``engine.cache.forward``): the family's."""
        raise NotImplementedError(f"{self.name} cuts no transformer call at its blocks")

    def take_cache_metrics(self) -> dict[str, CacheMetrics]:
        metrics, self._cache_metrics = self._cache_metrics, {}
        return metrics

    def _end_cache(self, state: StepRequestState) -> None:
        """A finished request's cache: its metrics kept for the reply, its state freed."""
        if state.cache is not None:
            self._cache_metrics[state.request_id] = state.cache.metrics()
            state.cache.free()

    # -- stages (shared by both execution modes) -----------------------------------
    def encode_prompt(self, request: DiffusionRequest) -> Conditioning:
        """Embeddings for one request, repeated per output; negatives when CFG runs."""
        return self.encode_prompts([request])[0]

    #: the family's text encoder reads an edit's input image with its prompt
    #: (Qwen-Image-Edit's Qwen2.5-VL): those prompts are encoded with their
    #: image, one request at a time, past the prompt cache (it keys by text)
    text_sees_images = False

    def encode_prompts(self, requests: list[DiffusionRequest],
                       inputs: list[InputPixels | None] | None = None) -> list[Conditioning]:
        """``encode_prompt`` for several requests with one text-encoder call (each
        prompt's embedding does not depend on the others: fixed lengths);
        edits whose text encoder sees their image (``text_sees_images``) apart."""
        seen = [i for i, r in enumerate(requests) if self.text_sees_images and inputs
                and inputs[i] is not None and self.spec.task_of(r) == "editing"]
        if not seen:
            return self._encode_texts(requests)
        out: list[Conditioning | None] = [None] * len(requests)
        rest = [i for i in range(len(requests)) if i not in seen]
        if rest:
            for i, cond in zip(rest, self._encode_texts([requests[i] for i in rest]), strict=True):
                out[i] = cond
        for i in seen:
            out[i] = self.encode_with_images(requests[i], inputs[i])  # type: ignore[index,arg-type]
        return out  # type: ignore[return-value]

    def encode_with_images(self, request: DiffusionRequest, inputs: InputPixels) -> Conditioning:
        """An edit's prompt (and negative) conditioned on its input images
        (uint8 (H, W, 3), as resized): the family's, where its text encoder sees images."""
        raise NotImplementedError(f"{self.name}'s text encoder reads no images")

    def _encode_texts(self, requests: list[DiffusionRequest]) -> list[Conditioning]:
        texts: list[str] = []
        for request in requests:
            texts.append(request.prompt)
            if self.spec.uses_cfg(request):
                texts.append(self.spec.negative_prompt(request) or "")
        embeds, extra = self.text_encoder(texts)
        self._count_cuts(requests)
        embeds, extra = embeds.to(self.device, self.dtype), extra.to(self.device, self.dtype)
        out, row = [], 0
        for request in requests:
            n = request.sampling_params.num_outputs_per_prompt
            e, x = embeds[row:row + 1].repeat_interleave(n, 0), extra[row:row + 1].repeat_interleave(n, 0)
            row += 1
            if not self.spec.uses_cfg(request):
                out.append(Conditioning(e, x))
                continue
            ne = embeds[row:row + 1].repeat_interleave(n, 0)
            nx = extra[row:row + 1].repeat_interleave(n, 0)
            row += 1
            out.append(Conditioning(e, x, ne, nx))
        return out

    def _count_cuts(self, requests: list[DiffusionRequest]) -> None:
        """Record, per request, the tokens each text encoder cut from its
        prompt and negative prompt (together), for the requests that lost any."""
        counter = getattr(self.text_encoder, "tokens_dropped", None)
        if counter is None:
            return
        for request in requests:
            cuts = Counter(counter(request.prompt))
            if self.spec.uses_cfg(request):
                cuts.update(counter(self.spec.negative_prompt(request) or ""))
            if cuts:
                self._prompt_cuts[request.request_id] = dict(cuts)

    def latent_size(self, params: SamplingParams) -> tuple[int, int]:
        """(height, width) of the request's latents (its size filled in at submission)."""
        f = self.vae_scale_factor
        return filled(params.height) // f, filled(params.width) // f

    def latent_shape(self, params: SamplingParams) -> tuple[int, int, int, int]:
        return (params.num_outputs_per_prompt, self.latent_channels, *self.latent_size(params))

    def prepare_latents(self, params: SamplingParams, seed: int) -> torch.Tensor:
        """Initial noise from the request's own CPU generator (device independent)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn(self.latent_shape(params), generator=generator, dtype=torch.float32)
        return self.pack_latents(noise.to(device=self.device, dtype=self.dtype))

    # -- input images (image-to-image, inpainting) -----------------------------------
    def encode_image_dist(self, pixels: torch.Tensor) -> Any:
        """The VAE's latent distribution of ``pixels`` ((B, 3, H, W) in [-1, 1]);
        its ``mean`` and ``std`` are what diffusers samples from."""
        return self.vae.encode(pixels, return_dict=False)[0]

    def normalize_image_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Sampled VAE latents -> the denoiser's latent space (as the family's
        diffusers ``_encode_vae_image``): shift, then scale."""
        return (latents - self.shift_factor) * self.scaling_factor

    def encode_images(self, pixels: list[torch.Tensor],
                      generators: list[torch.Generator] | None) -> list[torch.Tensor]:
        """Each request's input image ((1, 3, H, W)) -> its (1, C, h, w)
        latents, one VAE call per image size; each sample is drawn from its
        request's own generator, as ``retrieve_latents`` draws it (no
        ``generators``: the distribution's mode, ``sample_mode="argmax"``,
        as an editing pipeline encodes its input)."""
        out: list[torch.Tensor | None] = [None] * len(pixels)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            groups.setdefault(tuple(p.shape), []).append(i)
        for members in groups.values():
            batch = torch.cat([pixels[i] for i in members]).to(self.device, self.dtype)
            dist = self.encode_image_dist(batch)
            for row, i in enumerate(members):
                mean, std = dist.mean[row:row + 1], dist.std[row:row + 1]
                if generators is None:
                    out[i] = self.normalize_image_latents(mean)
                    continue
                sample = torch.randn(mean.shape, generator=generators[i], dtype=torch.float32)
                out[i] = self.normalize_image_latents(
                    mean + std * sample.to(mean.device, mean.dtype))
        return out  # type: ignore[return-value]

    def _input_pixels(self, state: StepRequestState) -> InputPixels | None:
        """The state's input images (read by the runner, or converted here)."""
        if state.inputs is None and state.request.images:
            request = state.request
            state.inputs = read_pixels(request, None,
                                       lambda w, h: self.spec.input_size(request, w, h),
                                       self.spec.prompt_image_size(request))
        return state.inputs

    def _start_from_image(self, state: StepRequestState, image_latents: torch.Tensor,
                          generator: torch.Generator, mask: torch.Tensor | None) -> None:
        """Image-to-image: the schedule from ``start_step`` on, and first latents
        that are the image noised to that step (``scale_noise``), as the
        family's diffusers img2img / inpaint pipeline prepares them; with a
        mask, what each step's blend needs (``apply_step``)."""
        params = state.request.sampling_params
        start = params.start_step()
        noise_scheduler = state.noise_scheduler
        noise_scheduler.set_begin_index(start)  # diffusers' get_timesteps (order 1)
        state.timesteps = state.timesteps[start:]  # type: ignore[index]
        state.start_step = start
        n = params.num_outputs_per_prompt
        noise = torch.randn(self.latent_shape(params), generator=generator,
                            dtype=torch.float32).to(self.device, self.dtype)
        image_latents = torch.cat([image_latents] * n) if n > 1 else image_latents
        first = noise_scheduler.scale_noise(image_latents, state.timesteps[:1].repeat(n), noise)
        state.latents = self.pack_latents(first)
        if mask is not None:
            state.inpaint = Inpaint(self.pack_latents(self.latent_mask(mask, params)),
                                    self.pack_latents(image_latents), self.pack_latents(noise))
            assert state.inputs is not None  # the mask came with its image
            state.overlay = Overlay(binarized(mask)[None, None].to(self.device, self.dtype),
                                    to_model_pixels(state.inputs.images[0]).to(
                                        self.device, self.dtype))

    def condition_on_images(self, state: StepRequestState,
                            image_latents: list[torch.Tensor]) -> None:
        """An edit: give the request its input images' (1, C, h, w) latents as
        conditioning (the family's way: extra tokens for FLUX.1 Kontext and
        Qwen-Image-Edit)."""
        raise NotImplementedError(f"{self.name} does not edit images")

    def row_input(self, state: StepRequestState) -> torch.Tensor:
        """What the state's rows give the transformer: its latents, followed by
        its conditioning tokens when it has any (an edit's input image)."""
        latents, edit = state.latents, state.edit
        assert latents is not None  # prepared
        return latents if edit is None else torch.cat([latents, edit.tokens], dim=1)

    def latent_mask(self, mask: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """A (H, W) uint8 mask -> (N, C, h, w) of 0 and 1 at the latents' size,
        as diffusers' mask processor and ``prepare_mask_latents`` make it
        (binarised at one half, nearest-neighbour down to the latents)."""
        m = torch.nn.functional.interpolate(binarized(mask)[None, None],
                                            size=self.latent_size(params))
        m = m.to(self.device, self.dtype)
        return m.repeat(params.num_outputs_per_prompt, self.latent_channels, 1, 1)

    def prepare_timesteps(self, params: SamplingParams) -> tuple[Any, torch.Tensor]:
        """A fresh noise-scheduler copy with its timesteps set, and those
        timesteps; never the shared template."""
        noise_scheduler = copy.deepcopy(self.noise_scheduler)
        steps = filled(params.num_inference_steps)
        noise_scheduler.set_timesteps(
            steps, device=self.device, **self.timestep_kwargs(steps, params)
        )
        return noise_scheduler, noise_scheduler.timesteps

    def guided_prediction(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
        guidance: torch.Tensor,
        layout: RowLayout,
        cfg_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Transformer call with CFG combined per row (uncond + s * (cond - uncond),
        ``s`` from ``cfg_scale``); ``guidance`` is the families' embedded input."""
        if cond.neg_embeds is None:
            if self.cfg_parallel_group is not None:  # no branches: the rows are shared out
                from diffrt.engine.parallel.cfg import gather_rows, rows_here

                rows = latents.shape[0]
                mine = rows_here(rows, self.cfg_parallel_group)
                # this rank's rows as long as their own longest (a padded step's
                # rows are the whole step's longest), padded back before the gather
                sub = layout.rows(mine)
                pred = self._transformer(
                    latents[mine][:, :sub.longest], timesteps[mine], cond.embeds[mine],
                    cond.extra[mine], guidance[mine], sub)
                if pred.shape[1] != latents.shape[1]:
                    pred = pad_tokens([pred], latents.shape[1])
                return gather_rows(pred, rows, self.cfg_parallel_group)
            return self._transformer(
                latents, timesteps, cond.embeds, cond.extra, guidance, layout
            )
        neg_embeds, neg_extra = cond.neg_embeds, cond.neg_extra
        assert neg_extra is not None  # the negative prompt's two outputs come together
        scale = cfg_scale if cfg_scale is not None else guidance
        if self.cfg_parallel_group is not None:  # one branch here, the other on the peer
            from diffrt.engine.parallel.cfg import cfg_branch, gather_branches

            conditional = cfg_branch(self.cfg_parallel_group)
            pred = self._transformer(
                latents, timesteps, cond.embeds if conditional else neg_embeds,
                cond.extra if conditional else neg_extra, guidance, layout)
            return self.combine_guidance(*gather_branches(pred, self.cfg_parallel_group), scale)
        pred = self._transformer(
            torch.cat([latents, latents]),
            torch.cat([timesteps, timesteps]),
            cat_rows([neg_embeds, cond.embeds]),
            cat_rows([neg_extra, cond.extra]),
            torch.cat([guidance, guidance]),
            layout + layout,
        )
        uncond, text = pred.chunk(2)
        return self.combine_guidance(text, uncond, scale)

    def _transformer(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor,
                     extra: torch.Tensor, guidance: torch.Tensor, layout: RowLayout
                     ) -> torch.Tensor:
        """``transformer_forward`` with the rows' LoRA adapters applied
        (``layout.loras``; the eager transformer then, not a compiled one:
        its hooks read per-call state)."""
        if not layout.loras and not layout.caches:
            return self.transformer_forward(latents, timesteps, embeds, extra, guidance, layout)
        compiled = self.transformer
        self.transformer = self.eager_transformer
        try:
            with self.row_loras.rows(layout.loras) if layout.loras else contextlib.nullcontext():
                if layout.caches:
                    return self._cached_transformer(latents, timesteps, embeds, extra, guidance,
                                                    layout)
                return self.transformer_forward(latents, timesteps, embeds, extra, guidance,
                                                layout)
        finally:
            self.transformer = compiled

    def _cached_transformer(self, latents: torch.Tensor, timesteps: torch.Tensor,
                            embeds: torch.Tensor, extra: torch.Tensor, guidance: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
        """A call in which some rows have a step cache: each request decides
        for its rows, the rows that compute run the blocks as one sub-batch
        (``engine.cache.forward``)."""
        rows_context = None
        if layout.loras:
            loras = layout.loras

            def rows_context(rows: list[int]) -> AbstractContextManager:
                return self.row_loras.rows(tuple(loras[r] for r in rows))

        with self.transformer_blocks(latents, timesteps, embeds, extra, guidance,
                                     layout) as blocks:
            return cached_call(blocks, layout.caches, layout.tokens, rows_context)

    def enable_loras(self, slots: int) -> dict[str, tuple[int, int]]:
        from diffrt.engine.lora.row_lora import RowLoras

        self.row_loras = RowLoras(self.transformer, slots, device=self.device, dtype=self.dtype)
        return self.row_loras.shapes()

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor,
                         scale: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance per row: ``uncond + s * (cond - uncond)``."""
        g = scale.view(-1, *([1] * (cond.dim() - 1))).to(cond.dtype)
        return uncond + g * (cond - uncond)

    def decode_latents(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Transformer-layout latents -> images in [-1, 1], (N, 3, H, W), on the device."""
        spatial = self.unpack_latents(latents, params)
        spatial = spatial / self.scaling_factor + self.shift_factor
        if self._vae_bands is not None:  # each rank its band of rows, then gathered
            from diffrt.engine.parallel.vae import parallel_decode

            images = parallel_decode(self.vae, spatial.to(self.dtype), self._vae_bands)
        else:
            images = self.vae.decode(spatial.to(self.dtype), return_dict=False)[0]
        return images.clamp(-1, 1)

    def finish(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """What the request asked for: decoded images, or (N, C, h, w) latents."""
        if params.output_type == "latent":
            return self.unpack_latents(latents, params)
        return self.decode_latents(latents, params)

    def _guidance_rows(self, params: SamplingParams) -> torch.Tensor:
        return torch.full(
            (params.num_outputs_per_prompt,), float(filled(params.guidance_scale)),
            device=self.device
        )

    def _cfg_rows(self, params: SamplingParams) -> torch.Tensor:
        return torch.full(
            (params.num_outputs_per_prompt,), self.spec.cfg_scale(params), device=self.device
        )

    # -- REQUEST_BATCH --------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: DiffusionRequestBatch) -> list[torch.Tensor]:
        # The engine accepts requests with their defaults filled in; a caller
        # using the pipeline directly may leave them at None.
        batch = DiffusionRequestBatch([self.prepared(r) for r in batch.requests], batch.loras,
                                      batch.inputs)
        params = batch.sampling_params
        _check_compatible(batch.requests, self.spec.request_batch_key)
        if batch.requests[0].images or (self.caches_here and any(
                self.spec.cache_plan(r.sampling_params) for r in batch.requests)):
            # equal tasks all from their input images, or requests with a step
            # cache: each keeps its own state between steps
            return self._forward_in_steps(batch)
        n = params.num_outputs_per_prompt
        latents = torch.cat(
            [
                self.prepare_latents(params, resolve_seed(r.sampling_params.seed))
                for r in batch.requests
            ]
        )
        cond = Conditioning.cat(self.encode_prompts(batch.requests))
        guidance = torch.cat([self._guidance_rows(r.sampling_params) for r in batch.requests])
        scales = torch.cat([self._cfg_rows(r.sampling_params) for r in batch.requests])
        noise_scheduler, timesteps = self.prepare_timesteps(params)
        layout = RowLayout.join([self.row_layout(params, None, batch.loras_of(i))
                                 for i in range(len(batch.requests))])
        for t in timesteps:
            pred = self.guided_prediction(
                latents, t.expand(latents.shape[0]), cond, guidance, layout, scales
            )
            latents = noise_scheduler.step(pred, t, latents, return_dict=False)[0]
            self.report_step()
        parts = self.finish(latents, params).split(n, dim=0)
        # Each request's tensor owns its storage: a view would carry (and, once
        # shared or pickled, ship) the whole batch's bytes.
        return [p.clone() for p in parts] if len(parts) > 1 else list(parts)

    def _forward_in_steps(self, batch: DiffusionRequestBatch) -> list[torch.Tensor]:
        """A fused forward of requests that start from input images or have a
        step cache: the step protocol over all of them at once (each keeps its
        own noise scheduler, begun at its start step, and its own cache; equal
        batch keys: they finish together)."""
        states = [StepRequestState(request=r, loras=batch.loras_of(i), inputs=batch.inputs_of(i))
                  for i, r in enumerate(batch.requests)]
        try:
            self.prepare_encode_batch(states)
            while not states[0].finished:
                parts = self.split_predictions(self.denoise_step(states), states)
                for state, part in zip(states, parts, strict=True):
                    self.apply_step(state, part)
                self.report_step()
            return self.post_decode_batch(states)
        finally:  # a failed forward's caches go with it
            for state in states:
                if state.cache is not None:
                    state.cache.free()

    # -- STEP_BATCH ----------------------------------------------------------------
    @torch.no_grad()
    def prepare_encode(self, state: StepRequestState) -> None:
        self.prepare_encode_batch([state])

    @torch.no_grad()
    def prepare_encode_batch(self, states: list[StepRequestState]) -> None:
        """``prepare_encode`` for the requests admitted in one tick, their
        prompts encoded in one text-encoder call and their input images in
        one VAE call per size."""
        for state in states:
            state.request = self.prepared(state.request)
        generators = [torch.Generator(device="cpu").manual_seed(
            resolve_seed(s.request.sampling_params.seed)) for s in states]
        with_images = [i for i, s in enumerate(states) if self._input_pixels(s) is not None]
        conds = self.encode_prompts([s.request for s in states], [s.inputs for s in states])
        edits = [i for i in with_images if self.spec.task_of(states[i].request) == "editing"]
        sampled = [i for i in with_images if i not in edits]
        image_latents: dict[int, list[torch.Tensor]] = {}
        if sampled:  # image-to-image, inpainting: one image, sampled with the request's generator
            for i, latents in zip(sampled, self.encode_images(
                    [to_model_pixels(states[i].inputs.images[0]) for i in sampled],  # type: ignore[union-attr]
                    [generators[i] for i in sampled]), strict=True):
                image_latents[i] = [latents]
        if edits:  # edits: every input image, the distribution's mode
            owners = [(i, image) for i in edits
                      for image in states[i].inputs.images]  # type: ignore[union-attr]
            for (i, _), latents in zip(owners, self.encode_images(
                    [to_model_pixels(image) for _, image in owners], None), strict=True):
                image_latents.setdefault(i, []).append(latents)
        for i, (state, cond) in enumerate(zip(states, conds, strict=True)):
            self._prepare_state(state, cond, generators[i], image_latents.get(i),
                                edit=i in edits)

    def _prepare_state(self, state: StepRequestState, cond: Conditioning,
                       generator: torch.Generator | None = None,
                       image_latents: list[torch.Tensor] | None = None, *,
                       edit: bool = False) -> None:
        params = state.request.sampling_params
        seed = resolve_seed(params.seed)
        state.seed = seed
        state.cond = cond
        state.guidance = self._guidance_rows(params)
        state.cfg_scale = self._cfg_rows(params)
        state.noise_scheduler, state.timesteps = self.prepare_timesteps(params)
        state.step = 0
        state.cache = self.new_cache(state)
        if image_latents is None or edit:  # an edit starts from noise, conditioned on its image
            state.latents = self.prepare_latents(params, seed)
            if image_latents is not None:
                self.condition_on_images(state, image_latents)
            return
        assert generator is not None and state.inputs is not None  # drawn with the image's
        self._start_from_image(state, image_latents[0], generator, state.inputs.mask)

    @torch.no_grad()
    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor:
        """One transformer call for every row of ``states``; rows of different
        sizes (``ModelSpec.mixed_sizes``) zero-padded to the longest
        (``segments``), their predictions cut back by ``split_predictions``."""
        _check_compatible([s.request for s in states], self.spec.mixed_step_batch_key
                          if self.spec.mixed_sizes else self.spec.step_batch_key)
        layout = RowLayout.join([self.row_layout(s.request.sampling_params, None, s.loras,
                                                 s.edit_sizes,
                                                 self._running_cache(s)) for s in states])
        if layout.uniform:
            latents = torch.cat([self.row_input(s) for s in states])
        elif self.mixed_rows == "by_size":
            return self._denoise_by_size(states, layout.longest)
        else:
            latents = pad_tokens([self.row_input(s) for s in states], layout.longest)
        timesteps = torch.cat(
            [s.timesteps[s.step].expand(s.latents.shape[0]) for s in states]  # type: ignore[index,union-attr]
        )
        cond = Conditioning.cat([_prepared(s.cond) for s in states])
        guidance = torch.cat([_prepared(s.guidance) for s in states])
        scales = torch.cat([_prepared(s.cfg_scale) for s in states])
        return self.guided_prediction(latents, timesteps, cond, guidance, layout, scales)

    def _denoise_by_size(self, states: list[StepRequestState], longest: int) -> torch.Tensor:
        """One transformer call per latent size among ``states``; the
        predictions, in the states' order, padded to ``longest`` tokens as a
        padded call's would be (``split_predictions`` cuts them back)."""
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault((self.latent_size(s.request.sampling_params),
                               s.edit_sizes), []).append(i)
        preds: list[torch.Tensor | None] = [None] * len(states)
        for members in groups.values():
            group = [states[i] for i in members]
            for i, pred in zip(members, super().split_predictions(
                    self.denoise_step(group), group), strict=True):
                preds[i] = pred
        return pad_tokens(preds, longest)  # type: ignore[arg-type]

    def split_predictions(self, noise_pred: torch.Tensor,
                          states: list[StepRequestState]) -> list[torch.Tensor]:
        """Each state's rows, cut back to its own tokens (a padded call's rows
        are as long as the longest)."""
        parts = super().split_predictions(noise_pred, states)
        return [part if part.shape == s.latents.shape  # type: ignore[union-attr]
                else part[:, :s.latents.shape[1]]  # type: ignore[union-attr]
                for part, s in zip(parts, states, strict=True)]

    @torch.no_grad()
    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        latents, timesteps = state.latents, state.timesteps
        assert latents is not None and timesteps is not None  # set when it was admitted
        t = timesteps[state.step]
        noise_scheduler = state.noise_scheduler
        inpaint = state.inpaint
        if state.preview_steps is None:
            state.preview_steps = tuple(state.request.sampling_params.preview_steps())
        if state.step + 1 in state.preview_steps:
            # flow matching: x_t = (1 - sigma) x0 + sigma noise and the model
            # predicts noise - x0, so x0 = x_t - sigma * prediction (the
            # schedule's index: an image-to-image request began at start_step)
            index = state.start_step + state.step
            sigma = noise_scheduler.sigmas[index].to(latents.dtype)
            x0 = latents - sigma * noise_pred
            if inpaint is not None:  # outside the mask the image is kept
                x0 = inpaint.keep_outside(x0, inpaint.image_latents)
            state.x0 = x0
        state.latents = noise_scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if inpaint is not None:
            self._blend_masked(state, inpaint)
        if state.cache is not None:  # its decision of this step becomes its own
            state.cache.commit()
        state.step += 1

    def _blend_masked(self, state: StepRequestState, inpaint: Inpaint) -> None:
        """Inpainting, after each step: outside the mask the latents are the
        input image noised to the next step (the image itself after the last),
        as diffusers' inpaint pipelines blend them."""
        timesteps = state.timesteps
        assert timesteps is not None and state.latents is not None
        proper = inpaint.image_latents
        if state.step + 1 < len(timesteps):
            proper = state.noise_scheduler.scale_noise(
                inpaint.image_latents, timesteps[state.step + 1:state.step + 2], inpaint.noise)
        state.latents = inpaint.keep_outside(state.latents, proper)

    @torch.no_grad()
    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        x0, state.x0 = state.x0, None
        if x0 is None:
            return None
        return self._restore_unmasked(state, self.finish(x0, state.request.sampling_params))

    @torch.no_grad()
    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        return self._restore_unmasked(
            state, self.finish(state.latents, state.request.sampling_params))  # type: ignore[arg-type]

    def _restore_unmasked(self, state: StepRequestState, images: torch.Tensor) -> torch.Tensor:
        """Inpainting: outside the mask the input's own pixels, not their VAE
        round trip (which drifts a few levels over the whole picture), as
        diffusers' ``apply_overlay`` pastes them back for a cropped inpaint;
        latents pass as they are."""
        overlay = state.overlay
        if overlay is None or state.request.sampling_params.output_type == "latent":
            return images
        return overlay.paste(images)

    @torch.no_grad()
    def post_decode_batch(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        """One VAE decode for requests finishing in the same tick (as forward does)."""
        for state in states:
            self._end_cache(state)
        if len(states) == 1:
            return [self.post_decode(states[0])]
        groups: dict[tuple, list[int]] = {}  # decoded together: same size and output
        for i, s in enumerate(states):
            params = s.request.sampling_params
            groups.setdefault((self.latent_size(params), params.output_type), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(states)
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = self.post_decode(states[members[0]])
                continue
            params = states[members[0]].request.sampling_params
            latents = torch.cat([states[i].latents for i in members])  # type: ignore[misc]
            parts = self.finish(latents, params).split(
                [states[i].request.sampling_params.num_outputs_per_prompt for i in members])
            for i, part in zip(members, parts, strict=True):
                # each request's tensor owns its storage
                out[i] = self._restore_unmasked(states[i], part).clone()
        return out  # type: ignore[return-value]
