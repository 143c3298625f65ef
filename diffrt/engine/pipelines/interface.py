"""The model contract every pipeline implements.

Both execution modes share one pipeline object:

* REQUEST_BATCH: ``forward(batch) -> list[Tensor]``, one entry per request of
  a ``DiffusionRequestBatch``; fused multi-request batches only when the
  model's spec declares ``supports_request_batch``.
* STEP_BATCH (the spec's ``supports_step_execution``): ``prepare_encode(state)``,
  then per tick ``denoise_step(states) -> pred`` (one forward for all states),
  ``split_predictions(pred, states)`` and ``apply_step(state, part)`` for each
  state, and ``post_decode(state)`` once it is finished. Everything
  request-local (latents, timesteps, its own copy of the diffusers noise
  scheduler in ``noise_scheduler``, prompt embeddings) lives in
  ``StepRequestState``; the pipeline object holds only weights and
  configuration.

What a pipeline returns per request is the *device* tensor of the decoded
images in [-1, 1], shape (num_outputs, C, H, W), or the latents for
output_type "latent". ``to_transfer`` (worker side, on the device, before any
copy) quantises images to uint8; ``engine.postprocess`` (engine side, off
the busy loop, as the spec's ``postprocess`` says) turns the host tensor into
what the user asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffrt.engine.cache.state import RequestCache
from diffrt.engine.input_images import InputPixels
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.pipelines.request_state import Conditioning, EditTokens, Inpaint, Overlay
from diffrt.engine.request import DiffusionRequest, OfRequest
from diffrt.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch.distributed as dist
    from diffusers import SchedulerMixin

    from diffrt.engine.cache.state import CacheBudget
    from diffrt.engine.outputs import CacheMetrics
    from diffrt.engine.parallel.groups import ParallelGroups
    from diffrt.engine.pipelines.flow_sde import RowNoise
    from diffrt.engine.weights.model_offload import ModelOffload
    from diffrt.engine.weights.offload import LayerwiseOffload
    from diffrt.platforms.interface import Platform

if TYPE_CHECKING:
    from diffrt.engine.outputs import TextEncoderStats


#: what a pipeline returns for one request: the device tensor of its images
#: (or latents), or, when it asked for its rollout (``flow_sde``),
#: ``{"images": that tensor, "rollout": {name: tensor}}``
RequestOutput = torch.Tensor | dict[str, Any]


@dataclass
class DiffusionRequestBatch:
    """Compatible requests that share one request-level forward."""

    requests: list[DiffusionRequest]
    #: each request's LoRA adapters as (device slot, scale) pairs, in order
    #: (empty: no request has any)
    loras: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    #: each request's input images as the worker read them, in order (empty:
    #: none has any; an entry None: that one has none)
    inputs: list[InputPixels | None] = field(default_factory=list)

    def loras_of(self, index: int) -> tuple[tuple[int, float], ...]:
        return self.loras[index] if self.loras else ()

    def inputs_of(self, index: int) -> InputPixels | None:
        return self.inputs[index] if self.inputs else None

    @property
    def sampling_params(self) -> SamplingParams:
        """The shared parameters (compatible requests agree on the batch key)."""
        return self.requests[0].sampling_params

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepRequestState(OfRequest):
    """Request-local state of a STEP_BATCH request, owned by the worker.

    The pipeline fills it in ``prepare_encode`` and reads it in every step:
    its latents and schedule, its prompt embeddings (``cond``) and per-row
    scales, and what its task adds (``inpaint``/``overlay``: an inpainting
    request; ``edit``: an edit's input-image tokens; ``start_step``: an
    image-to-image request's first step)."""

    request: DiffusionRequest
    latents: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    step: int = 0
    noise_scheduler: SchedulerMixin | None = None  # this request's own copy of the diffusers noise scheduler
    #: its LoRA adapters as (device slot, scale) pairs (``engine.lora``)
    loras: tuple[tuple[int, float], ...] = ()
    #: its input images as the worker read them (None: none, or not read yet:
    #: a pipeline called directly converts the request's own)
    inputs: InputPixels | None = None
    #: its step cache (None: it runs uncached)
    cache: RequestCache | None = None
    #: the seed its noise was drawn with (a request without one draws it here)
    seed: int | None = None
    #: its prompt embeddings, repeated per output (and the negative's under CFG)
    cond: Conditioning | None = None
    #: per row: the family's embedded guidance input, and the CFG scale
    guidance: torch.Tensor | None = None
    cfg_scale: torch.Tensor | None = None
    #: the schedule's index of its first step (image-to-image: past 0)
    start_step: int = 0
    inpaint: Inpaint | None = None
    overlay: Overlay | None = None
    edit: EditTokens | None = None
    #: the steps after which it previews (``SamplingParams.preview_steps``),
    #: and the clean-image prediction of the last such step, until decoded
    preview_steps: tuple[int, ...] | None = None
    x0: torch.Tensor | None = None
    #: its outputs' own noise state and what it records of its steps (a
    #: rollout: ``flow_sde.RowNoise``; None: the default sampler, one seed)
    rollout: RowNoise | None = None
    #: a family's own per-request struct, where it needs one (its tensors
    #: are counted by ``nbytes`` like the rest)
    family_state: Any = None

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

    @property
    def rows(self) -> int:
        """Its rows in a transformer call (one per output), once prepared."""
        if self.latents is None:
            raise RuntimeError(f"{self.request_id}: not prepared (no latents)")
        return self.latents.shape[0]

    @property
    def edit_sizes(self) -> tuple[tuple[int, int], ...]:
        """The latent sizes of its edit's input images (() when it edits none)."""
        return self.edit.sizes if self.edit is not None else ()

    def nbytes(self) -> int:
        """The bytes this state holds: its latents, schedule, prompt
        embeddings and task tensors, its family's state, its input pixels,
        its noise scheduler's tensors and its step cache (each view once)."""
        seen: set[tuple[int, int, int]] = set()
        values = [self.latents, self.timesteps, self.cond, self.guidance, self.cfg_scale,
                  self.rollout,
                  self.inpaint, self.overlay, self.edit, self.x0, self.family_state,
                  self.inputs,
                  vars(self.noise_scheduler) if hasattr(self.noise_scheduler, "__dict__") else None]
        total = _tensor_bytes(values, seen)
        return total + (self.cache.nbytes if self.cache is not None else 0)


def _tensor_bytes(value: object, seen: set[tuple[int, int, int]]) -> int:
    """The bytes of the tensors in ``value`` and in the lists, tuples, dicts
    and dataclasses it nests, each view once (other objects count nothing)."""
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.numel(), value.element_size())
        if key in seen:  # the same view twice (a slice of a batch counts its own part)
            return 0
        seen.add(key)
        return value.numel() * value.element_size()
    if is_dataclass(value) and not isinstance(value, type):
        return _tensor_bytes(vars(value), seen)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    return 0


class DiffusionPipeline(ABC):
    """Base class of diffrt pipelines: weights and compute, no request state
    and no submission checks (what a request may ask is the model's ``ModelSpec``,
    read by the engine; the pipeline consults the same spec for the decisions
    it shares with the engine, such as whether CFG runs)."""

    #: the model's description (set by ``load``)
    spec: ModelSpec
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    #: set by the runner: called by ``report_step`` (a sign of progress for
    #: the hang watchdog during a long request-style forward).
    step_hook: Callable[[], None] | None = None
    #: set by ``enable_parallel`` with ``cfg_parallel_size=2``: the two-rank
    #: group whose rank 0 computes the conditional branch of CFG and rank 1
    #: the other (``engine.parallel.cfg``); None computes both branches here.
    cfg_parallel_group: dist.ProcessGroup | None = None
    #: set by the runner (``ModelConfig.mixed_rows``, resolved): how rows of
    #: different sizes share a step in a pipeline whose spec has
    #: ``mixed_sizes`` — "padded" (one call) or "by_size" (a call per size)
    mixed_rows: str = "padded"
    #: set by ``enable_loras``: the device slots of LoRA adapters and the
    #: hooked layers that apply them per row (``engine.lora.row_lora``)
    row_loras: Any = None
    #: set by the runner: the bound on its requests' step-cache state
    #: (``engine.cache.state.CacheBudget``; None until then)
    cache_budget: CacheBudget | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def report_step(self) -> None:
        """Call once per denoise step inside ``forward``: a forward of many
        steps is then not mistaken for a hung worker."""
        if self.step_hook is not None:
            self.step_hook()

    # -- construction (the registry calls it) ----------------------------------------
    @classmethod
    def load(cls, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
        """Build the pipeline ``spec`` describes on ``device`` (from
        ``spec.folder`` when it has one), with ``spec`` set on it."""
        raise NotImplementedError(f"{cls.__name__} does not implement load()")

    def prepared(self, request: DiffusionRequest) -> DiffusionRequest:
        """``request`` as it will run: the spec's defaults for the fields it
        left at None, checked (the engine accepts requests this way already;
        a caller using the pipeline directly may not have)."""
        request = self.spec.with_defaults(request)
        self.spec.check(request)
        return request

    # -- REQUEST_BATCH -------------------------------------------------------
    @abstractmethod
    def forward(self, batch: DiffusionRequestBatch) -> list[RequestOutput]:
        """Run whole requests; return one output (a device tensor, or one with
        its rollout) per request, in order."""

    # -- STEP_BATCH ----------------------------------------------------------
    def prepare_encode(self, state: StepRequestState) -> None:
        """Encode prompts, draw latents, set timesteps and ``noise_scheduler``
        (a fresh copy of the diffusers noise scheduler)."""
        raise NotImplementedError(f"{type(self).__name__} does not support step execution")

    def prepare_encode_batch(self, states: list[StepRequestState]) -> None:
        """``prepare_encode`` for the requests admitted in one tick; override to
        encode their prompts in one call (the default prepares them one by one)."""
        for state in states:
            self.prepare_encode(state)

    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor:
        """One transformer forward for all states; returns noise predictions stacked
        along dim 0 in the order of ``states`` (CFG already combined). Changes no
        state: only ``apply_step`` advances latents."""
        raise NotImplementedError(f"{type(self).__name__} does not support step execution")

    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        """Advance one request's latents by its slice of the prediction (from
        ``split_predictions``) through its ``noise_scheduler``, and increment
        its ``step``."""
        raise NotImplementedError(f"{type(self).__name__} does not support step execution")

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """Decode a finished request; same result as the tail of ``forward``."""
        raise NotImplementedError(f"{type(self).__name__} does not support step execution")

    def post_decode_batch(self, states: list[StepRequestState]) -> list[RequestOutput]:
        """Decode several finished requests of one step batch (their step batch
        keys agree); one output per state, in order. The default decodes them
        one by one; override to decode them in one call (the engine's runner
        uses this when requests finish in the same tick)."""
        return [self.post_decode(state) for state in states]

    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The request's image as predicted now (what ``post_decode`` returns,
        from the current clean-image prediction), or None when this pipeline
        has none. Called after ``apply_step`` at the request's preview steps
        (``SamplingParams.preview_steps``)."""
        return None

    def split_predictions(
        self, noise_pred: torch.Tensor, states: list[StepRequestState]
    ) -> list[torch.Tensor]:
        """Slice ``denoise_step``'s output back to each state, in order (each
        state owns as many rows as its latents)."""
        sizes = [s.rows for s in states]
        return list(noise_pred.split(sizes, dim=0))

    def configure_memory(self, *, vae_tiling: bool = False,  # noqa: B027
                         vae_slicing: bool = False) -> None:
        """Trade speed for decode memory: VAE decoding in tiles (large images)
        or one image at a time (large batches). Pipelines without them ignore
        it. (What stays on the device between uses: ``enable_model_offload``.)"""

    def weight_modules(self) -> dict[str, torch.nn.Module]:
        """Component name -> module, for counting resident weight bytes
        (``engine.weights.resident``); empty where a pipeline has none."""
        return {}

    def quantize_weights(self, method: str, text_method: str = "none") -> None:
        """Convert the weights (``EngineConfig.quantization``); a pipeline whose
        spec declares no methods is never asked."""
        raise NotImplementedError(f"{self.name} has no lower-precision weights")

    def enable_layerwise_offload(self, platform: Platform, prefetch: int = 1, *,
                                 device: torch.device | None = None) -> LayerwiseOffload:
        """Stream the denoiser's blocks from host memory to ``device`` (the
        pipeline's when None; a model loaded into host memory first computes
        elsewhere: ``place_weights``) (``offload="layerwise"``)."""
        raise NotImplementedError(f"{self.name} has no layer-wise offload")

    def enable_model_offload(self, platform: Platform, kept: tuple[str, ...] = (), *,
                             device: torch.device | None = None) -> ModelOffload:
        """Keep whole components (``weight_modules``; all but ``kept``) in host
        memory and move each to the device when it runs (``offload="model"``,
        ``offload_text_encoders``)."""
        raise NotImplementedError(f"{self.name} has no model offload")

    def place_weights(self, device: torch.device, *, on_host: tuple[str, ...] = ()) -> None:
        """Compute on ``device`` from now on and move there every component of
        ``weight_modules`` not named in ``on_host``. The runner loads a model
        into host memory when its weights are converted or offloaded first (the
        full-precision model need not fit the device), then calls this."""
        raise NotImplementedError(f"{self.name} cannot load its weights on the host first")

    def enable_loras(self, slots: int) -> dict[str, tuple[int, int]]:
        """Give the denoiser ``slots`` device slots for LoRA adapters applied
        per row (``row_loras``); return its linear layers, name -> (out, in),
        what an adapter file must fit. A pipeline whose spec names no
        ``lora_target_modules`` is never asked."""
        raise NotImplementedError(f"pipeline {self.name!r} takes no LoRA adapters")

    def enable_parallel(self, groups: ParallelGroups, *, vae_parallel: bool = False) -> None:
        """Split each request across the ranks of ``groups`` (an
        ``engine.parallel.ParallelGroups``; every rank holds the full weights),
        on every rank alike; called once, after loading. A pipeline without
        parallelism refuses."""
        raise NotImplementedError(f"pipeline {self.name!r} has no multi-rank parallelism")

    def compile_models(self, backend: str) -> None:  # noqa: B027 (optional hook)
        """``torch.compile`` the denoiser with ``backend``. It compiles on first
        use, and again when a shape first changes (then with that dimension
        dynamic). A long compile is a worker call without heartbeats: with a
        large model raise ``execute_timeout_s`` accordingly. Pipelines without
        a compilable denoiser ignore it."""

    def enable_prompt_cache(self, max_bytes: int, *,  # noqa: B027 (optional hook)
                            synchronize: Callable[[], None] | None = None) -> None:
        """Keep prompt embeddings (LRU, at most ``max_bytes``; 0 keeps none) and
        count text-encoding work, timed up to ``synchronize()`` (the device's)
        so the seconds include the device work. Pipelines without a text
        encoder of their own ignore it."""

    def text_encoder_stats(self) -> TextEncoderStats | None:
        """Cumulative text-encoding counters (after ``enable_prompt_cache``), or
        None for a pipeline that does not count."""
        return None

    def take_prompt_cuts(self) -> dict[str, dict[str, int]]:
        """Request id -> text encoder -> the tokens it cut from the request's
        prompts, for the requests encoded since the last call that lost any
        (a prompt longer than an encoder takes is cut, as diffusers cuts it);
        {} from a pipeline that does not count."""
        return {}

    def take_cache_metrics(self) -> dict[str, CacheMetrics]:
        """Request id -> what its step cache did (``outputs.CacheMetrics``), for
        the requests that finished with one since the last call; {} from a
        pipeline without step caches."""
        return {}

    # -- output hooks --------------------------------------------------------
    def to_transfer(self, output: RequestOutput, params: SamplingParams) -> Any:
        """Worker side, on the device, before any copy: images become uint8
        (N, H, W, C) so 4x fewer bytes cross to the host; latents pass as is
        (and a rollout's tensors beside them)."""
        from diffrt.engine.postprocess import quantize_images

        if isinstance(output, dict):
            return {**output, "images": self.to_transfer(output["images"], params)}
        return output if params.output_type == "latent" else quantize_images(output)

    # -- set by the worker's set-up plan (``engine.worker_setup``) ---------------
    def use_mixed_rows(self, arrangement: str) -> None:
        """How rows of different sizes share a step (``mixed_rows``, resolved
        for the platform: "padded", "by_size" or "packed")."""
        self.mixed_rows = arrangement

    def use_cache_budget(self, budget: CacheBudget) -> None:
        """The bound on this worker's step-cache state
        (``engine.cache.state.CacheBudget``)."""
        self.cache_budget = budget

    def use_step_hook(self, hook: Callable[[], None] | None) -> None:
        """Called by ``report_step``: a sign of progress from inside a forward."""
        self.step_hook = hook
