"""A pipeline's components and what the worker's set-up does to them.

``ComponentsPipeline`` holds the loaded modules — the transformer, the VAE,
the text encoder — and implements the set-up the runner applies to them
once, after loading: weight conversion, layer-wise and model offload,
placement, multi-rank parallelism, LoRA slots, compilation, the prompt
cache. None of it runs per request; the denoise loop (``denoise.py``) only
reads what they leave: ``transformer`` (compiled or not) beside
``eager_transformer`` (its own modules), ``row_loras``,
``cfg_parallel_group``, ``sequence_split`` and the VAE's bands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from diffrt.engine.model_spec import check_heads
from diffrt.engine.outputs import TextEncoderStats
from diffrt.engine.pipelines.interface import DiffusionPipeline
from diffrt.engine.pipelines.prompt_cache import CachedTextEncoder, TextEncoder
from diffrt.engine.pipelines.segments import RowLayout
from diffrt.platforms.interface import Platform

if TYPE_CHECKING:
    import torch.distributed as dist
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, ModelMixin

    from diffrt.engine.parallel.groups import ParallelGroups
    from diffrt.engine.parallel.vae import Bands
    from diffrt.engine.weights.model_offload import ModelOffload

if TYPE_CHECKING:
    from diffrt.engine.parallel.sequence import SequenceSplit
    from diffrt.engine.weights.offload import LayerwiseOffload


#: a module placed keeps its type
M = TypeVar("M", bound=torch.nn.Module)


def place(module: M, device: torch.device) -> M:
    """Move a loaded model to the device, in eval mode. Its dtype was set when it
    was loaded (``from_pretrained(dtype=...)``), which keeps the layers a model
    declares float32-only (T5's ``wo``) in float32; a later ``.to(dtype)``
    would cast those too and give other pixels than diffusers."""
    return module.to(device).eval()


class ComponentsPipeline(DiffusionPipeline):
    """The components of a transformer + VAE + text-encoder pipeline and
    their set-up (see the module)."""

    #: the denoiser as it is called: its own modules, or a ``torch.compile``
    #: wrapper of them (``compile_models``)
    transformer: ModelMixin
    vae: AutoencoderKL | AutoencoderKLQwenImage
    #: prompts -> (embeds, extra), one row per prompt (FolderTextEncoder),
    #: under the prompt cache once ``enable_prompt_cache`` ran
    text_encoder: TextEncoder
    #: set by ``enable_parallel``: the split of each call's image tokens
    #: over the sequence group (``engine.parallel.sequence``), and the VAE
    #: decoder's bands over all ranks (``engine.parallel.vae``)
    sequence_split: SequenceSplit | None = None
    vae_bands: Bands | None = None
    #: set by ``enable_layerwise_offload`` / ``enable_model_offload``
    offload: LayerwiseOffload | None = None
    model_offload: ModelOffload | None = None

    @property
    def eager_transformer(self) -> ModelMixin:
        """The transformer's own modules (under a ``torch.compile`` wrapper)."""
        return getattr(self.transformer, "_orig_mod", self.transformer)

    def denoiser(self, layout: RowLayout) -> ModelMixin:
        """The model a call over ``layout`` runs: the eager one when its rows
        carry LoRA adapters (their hooks read per-call state a compiled graph
        would not see), else ``transformer``, compiled or not."""
        return self.eager_transformer if layout.loras else self.transformer

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

    # -- weights (``engine.weights``) ------------------------------------------------
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

    def offload_blocks(self) -> list[torch.nn.Module]:
        """The blocks layer-wise offload streams, in the order they run: the
        transformer's (a family with a second transformer adds its own)."""
        from diffrt.engine.weights.offload import transformer_blocks

        return transformer_blocks(self.eager_transformer)

    def enable_layerwise_offload(self, platform: Platform, prefetch: int = 1, *,
                                 device: torch.device | None = None) -> LayerwiseOffload:
        """The transformer's blocks to host memory, streamed to ``device``
        (default: the pipeline's) per call: the call layer
        ``transformer_call.BlockOffload`` installs its hooks."""
        from diffrt.engine.pipelines.transformer_call import BlockOffload

        return BlockOffload.install(self, platform, prefetch, device or self.device)

    def enable_model_offload(self, platform: Platform, kept: tuple[str, ...] = (), *,
                             device: torch.device | None = None) -> ModelOffload:
        """Whole components to host memory, each moved to ``device`` (default:
        the pipeline's) when it runs (``engine.weights.model_offload``)."""
        from diffrt.engine.weights.model_offload import ModelOffload

        self.model_offload = ModelOffload(self.weight_modules(), platform,
                                          device or self.device, kept=kept)
        return self.model_offload

    def place_weights(self, device: torch.device, *, on_host: tuple[str, ...] = ()) -> None:
        """Move the components not in ``on_host`` to ``device`` and compute
        there; under layer-wise offload the transformer's blocks stay in their
        host buffers and only the rest of it moves (of each transformer whose
        blocks it streams: Wan 2.2's second expert too)."""
        self.device = self.text_encoder.device = torch.device(device)
        for name, module in self.weight_modules().items():
            if name in on_host:
                continue
            if name.startswith("transformer") and self.offload is not None:
                self.offload.place_rest(module, self.device)
            else:
                place(module, self.device)

    # -- parallelism, adapters, prompts ------------------------------------------------
    def enable_parallel(self, groups: ParallelGroups, *, vae_parallel: bool = False) -> None:
        """CFG branches over ``groups.cfg``, image tokens over
        ``groups.sequence`` (the call layer ``SequenceShard`` installs the
        family's ``sequence_hooks``), the
        VAE decode in bands over all ranks (``engine.parallel.vae``)."""
        self.spec.check_parallel(groups.degrees, vae_parallel)
        check_heads(getattr(self.transformer.config, "num_attention_heads", None),
                     groups.degrees.ulysses)  # the loaded model's, whatever the class said
        self.cfg_parallel_group = groups.cfg
        if groups.sequence is not None:  # the call layer installs the family's hooks
            from diffrt.engine.pipelines.transformer_call import SequenceShard

            SequenceShard.install(self, groups.sequence, groups.sequence_attention())
        if vae_parallel:
            self.vae_bands = self.band_decoder(groups.all_ranks)

    def band_decoder(self, group: dist.ProcessGroup | None) -> Bands:
        """The VAE's decoder converted to decode in bands over ``group``
        (an AutoencoderKL's; a family with another VAE converts its own)."""
        from diffrt.engine.parallel.vae import convert_decoder

        return convert_decoder(self.vae.decoder, group)

    def sequence_hooks(self, split: SequenceSplit) -> None:
        """The family's model hooks that shard each call's image tokens and
        attend over the group (``transformer_call.SequenceShard`` installs
        them, once)."""
        raise NotImplementedError(f"{self.name} has no sequence parallelism")

    def enable_loras(self, slots: int) -> dict[str, tuple[int, int]]:
        from diffrt.engine.lora.row_lora import RowLoras

        self.row_loras = RowLoras(self.transformer, slots, device=self.device, dtype=self.dtype)
        return self.row_loras.shapes()

    def enable_prompt_cache(self, max_bytes: int, *,
                            synchronize: Callable[[], None] | None = None) -> None:
        if not isinstance(self.text_encoder, CachedTextEncoder):
            self.text_encoder = CachedTextEncoder(self.text_encoder, max_bytes, synchronize)

    def text_encoder_stats(self) -> TextEncoderStats | None:
        if isinstance(self.text_encoder, CachedTextEncoder):
            return self.text_encoder.stats()
        return None


__all__ = ["ComponentsPipeline", "place"]
