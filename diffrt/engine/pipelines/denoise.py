"""The denoise loop of a flow-matching pipeline, for both execution modes.

Prepare (``prepare_encode_batch``): each request's conditioning
(``conditioning.Conditioner``), its first latents in the family's layout
(``latents.LatentLayout``), its own noise-scheduler copy and schedule, its
step cache. Step (``denoise_step`` -> ``split_predictions`` ->
``apply_step``): one transformer call for every row of the tick
(``transformer_call``: the family's call inside its feature layers), CFG
combined per row, each request's latents advanced by its own scheduler (and
blended back outside an inpainting mask). Decode (``post_decode_batch``):
one VAE call per latent size. ``forward`` (a whole request batch) runs the
same stages, so a request gives the same image in either mode::

    prepare ─► [ rows of the tick ─► CFG rows ─► TransformerCall ─► combine ─► step ]* ─► decode
                                                 │ RowsBySize ─ LoraRows ─ StepCache │
                                                 └────────── FamilyCall ─────────────┘

Batch invariance: each request draws its latents from its own CPU generator
seeded by its seed, text embeddings have a fixed length, and guidance is
applied per row, so a request's image does not depend on its batch mates
(up to floating-point reassociation in batched matmuls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from diffrt.engine.cache.state import DEFAULT_CACHE_STATE_BYTES, CacheBudget, RequestCache
from diffrt.engine.outputs import CacheMetrics
from diffrt.engine.pipelines.conditioning import Conditioner, resolve_seed
from diffrt.engine.pipelines.contract import FlowMatchHost
from diffrt.engine.pipelines.flow_sde import RowNoise, draw_noise
from diffrt.engine.pipelines.interface import (
    DiffusionRequestBatch,
    RequestOutput,
    StepRequestState,
)
from diffrt.engine.pipelines.prompt_cache import cat_rows
from diffrt.engine.pipelines.request_state import Conditioning
from diffrt.engine.pipelines.segments import RowLayout, pad_tokens
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams, filled

T = TypeVar("T")


def prepared(value: T | None) -> T:
    """A field ``prepare_encode`` set (a step of an unprepared state is a bug)."""
    assert value is not None, "a step of a request that was not prepared"
    return value


def check_compatible(requests: list[DiffusionRequest],
                     key: Callable[[DiffusionRequest], object]) -> None:
    """Refuse a batch the engine should not have formed (a bug, not user input)."""
    first = key(requests[0])
    for other in requests[1:]:
        if key(other) != first:
            raise ValueError(
                f"incompatible requests in one batch: {key.__name__} {key(other)} != {first}")


class DenoiseLoop:
    """The loop's stages over one pipeline (see the module)."""

    def __init__(self, host: FlowMatchHost, conditioner: Conditioner):
        self.host = host
        self.conditioner = conditioner
        #: request id -> its step cache's metrics, since ``take_cache_metrics``
        self.cache_metrics: dict[str, CacheMetrics] = {}

    # -- per-row inputs --------------------------------------------------------------
    def guidance_rows(self, params: SamplingParams) -> torch.Tensor:
        return torch.full((params.num_outputs_per_prompt,), float(filled(params.guidance_scale)),
                          device=self.host.device)

    def cfg_rows(self, params: SamplingParams) -> torch.Tensor:
        return torch.full((params.num_outputs_per_prompt,), self.host.spec.cfg_scale(params),
                          device=self.host.device)

    def first_latents(self, params: SamplingParams, seed: int) -> torch.Tensor:
        """Initial noise from the request's own CPU generator (device
        independent), in the transformer's layout."""
        host = self.host
        noise = host.latents.noise(params, torch.Generator(device="cpu").manual_seed(seed))
        return host.latents.pack(noise.to(device=host.device, dtype=host.dtype))

    @staticmethod
    def row_input(state: StepRequestState) -> torch.Tensor:
        """What the state's rows give the transformer: its latents, followed by
        its conditioning tokens when it has any (an edit's input images)."""
        latents = prepared(state.latents)
        return latents if state.edit is None else torch.cat([latents, state.edit.tokens], dim=1)

    # -- REQUEST_BATCH ---------------------------------------------------------------
    def forward(self, batch: DiffusionRequestBatch) -> list[RequestOutput]:
        host = self.host
        # The engine accepts requests with their defaults filled in; a caller
        # using the pipeline directly may leave them at None.
        batch = DiffusionRequestBatch([host.prepared(r) for r in batch.requests], batch.loras,
                                      batch.inputs)
        params = batch.sampling_params
        check_compatible(batch.requests, host.spec.request_batch_key)
        if batch.requests[0].images or any(r.sampling_params.keeps_row_noise
                                           or r.sampling_params.deterministic
                                           for r in batch.requests) or (self.caches_here and any(
                host.spec.cache_plan(r.sampling_params) for r in batch.requests)):
            # equal tasks all from their input images, requests with a step
            # cache or with noise of their own (rollouts, seeds per output):
            # each keeps its own state between steps
            return self.forward_in_steps(batch)
        n = params.num_outputs_per_prompt
        latents = torch.cat([self.first_latents(params, resolve_seed(r.sampling_params.seed))
                             for r in batch.requests])
        cond = Conditioning.cat(self.conditioner.encode_prompts(batch.requests))
        guidance = torch.cat([self.guidance_rows(r.sampling_params) for r in batch.requests])
        scales = torch.cat([self.cfg_rows(r.sampling_params) for r in batch.requests])
        noise_scheduler, timesteps = host.prepare_timesteps(params)
        layout = RowLayout.join([host.row_layout(params, None, batch.loras_of(i))
                                 for i in range(len(batch.requests))])
        for t in timesteps:
            pred = self.guided_prediction(latents, t.expand(latents.shape[0]), cond, guidance,
                                          layout, scales)
            latents = noise_scheduler.step(pred, t, latents, return_dict=False)[0]
            host.report_step()
        parts = self.finish(latents, params).split(n, dim=0)
        # Each request's tensor owns its storage: a view would carry (and, once
        # shared or pickled, ship) the whole batch's bytes.
        return [p.clone() for p in parts] if len(parts) > 1 else list(parts)

    def forward_in_steps(self, batch: DiffusionRequestBatch) -> list[RequestOutput]:
        """A fused forward of requests that start from input images or have a
        step cache: the step protocol over all of them at once (each keeps its
        own noise scheduler, begun at its start step, and its own cache; equal
        batch keys: they finish together)."""
        host = self.host
        states = [StepRequestState(request=r, loras=batch.loras_of(i), inputs=batch.inputs_of(i))
                  for i, r in enumerate(batch.requests)]
        try:
            host.prepare_encode_batch(states)
            while not states[0].finished:
                parts = host.split_predictions(host.denoise_step(states), states)
                for state, part in zip(states, parts, strict=True):
                    host.apply_step(state, part)
                host.report_step()
            return host.post_decode_batch(states)
        finally:  # a failed forward's caches go with it
            for state in states:
                if state.cache is not None:
                    state.cache.free()

    # -- STEP_BATCH: prepare ---------------------------------------------------------
    def prepare_encode_batch(self, states: list[StepRequestState]) -> None:
        """The requests admitted in one tick: their prompts encoded in one
        text-encoder call and their input images in one VAE call per size."""
        host = self.host
        for state in states:
            state.request = host.prepared(state.request)
        generators = [torch.Generator(device="cpu").manual_seed(
            resolve_seed(s.request.sampling_params.seed)) for s in states]
        image_latents, edits = self.conditioner.encode_inputs(states, generators)
        conds = self.conditioner.encode_prompts([s.request for s in states],
                                                [s.inputs for s in states])
        for i, (state, cond) in enumerate(zip(states, conds, strict=True)):
            self.prepare_state(state, cond, generators[i], image_latents.get(i), edit=i in edits)

    def prepare_state(self, state: StepRequestState, cond: Conditioning,
                      generator: torch.Generator, image_latents: list[torch.Tensor] | None, *,
                      edit: bool = False) -> None:
        host = self.host
        params = state.request.sampling_params
        state.seed = resolve_seed(params.seed)
        state.cond = cond
        state.guidance = self.guidance_rows(params)
        state.cfg_scale = self.cfg_rows(params)
        state.noise_scheduler, state.timesteps = host.prepare_timesteps(params)
        state.step = 0
        state.cache = self.new_cache(state)
        if params.keeps_row_noise:  # a rollout: text-to-image (ModelSpec.check_rollout)
            self.prepare_rollout(state)
            return
        if image_latents is None or edit:  # an edit starts from noise, conditioned on its image
            state.latents = self.first_latents(params, state.seed)
            if image_latents is not None:
                host.condition_on_images(state, image_latents)
            return
        self.conditioner.start_from_image(state, image_latents[0], generator)

    def prepare_rollout(self, state: StepRequestState) -> None:
        """A request with noise of its own (``flow_sde.RowNoise``): its first
        latents from its generators (one per output with ``seeds``), its
        schedule and first latents recorded."""
        host = self.host
        params = state.request.sampling_params
        rollout = state.rollout = RowNoise.of(params, prepared(state.seed))
        noise = draw_noise(host.latents, params, rollout.generators)
        state.latents = host.latents.pack(noise.to(device=host.device, dtype=host.dtype))
        steps = state.total_steps
        rollout.timesteps = prepared(state.timesteps)[:steps]
        sigmas = prepared(state.noise_scheduler).sigmas
        rollout.sigmas = sigmas[state.start_step:state.start_step + steps + 1]
        rollout.record(state.latents, self.unpacker(params))

    def unpacker(self, params: SamplingParams) -> Callable[[torch.Tensor], torch.Tensor]:
        """Transformer-layout latents of a request -> the VAE's layout."""
        layout, size = self.host.latents, self.host.latents.size(params)
        return lambda latents: layout.unpack(latents, size)

    # -- STEP_BATCH: step ------------------------------------------------------------
    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor:
        """``denoise_rows`` for ``states``, except that a request asking for
        batch invariance (``SamplingParams.deterministic``) gets a call of
        its own: the same call it would get alone, so the same bits. The
        predictions are padded to the longest, as one call's are."""
        alone = [s for s in states if s.request.sampling_params.deterministic]
        if not alone or len(states) == 1:
            return self.denoise_rows(states)
        rest = [s for s in states if not s.request.sampling_params.deterministic]
        parts: dict[int, torch.Tensor] = {}
        for group in [[s] for s in alone] + ([rest] if rest else []):
            pred = self.denoise_rows(group)
            parts.update({id(s): p for s, p in zip(
                group, self.split_predictions(pred, group), strict=True)})
        ordered = [parts[id(s)] for s in states]
        if len({p.shape[1:] for p in ordered}) == 1:
            return torch.cat(ordered)
        return pad_tokens(ordered, max(p.shape[1] for p in ordered))

    def denoise_rows(self, states: list[StepRequestState]) -> torch.Tensor:
        """One transformer call for every row of ``states``; rows of different
        sizes (``ModelSpec.mixed_sizes``) zero-padded to the longest
        (``segments``), their predictions cut back by ``split_predictions``."""
        host = self.host
        spec = host.spec
        check_compatible([s.request for s in states],
                         spec.mixed_step_batch_key if spec.mixed_sizes else spec.step_batch_key)
        layout = RowLayout.join([host.row_layout(s.request.sampling_params, None, s.loras,
                                                 s.edit_sizes, self.running_cache(s))
                                 for s in states])
        inputs = [self.row_input(s) for s in states]
        latents = torch.cat(inputs) if layout.uniform else pad_tokens(inputs, layout.longest)
        timesteps = torch.cat([prepared(s.timesteps)[s.step].expand(prepared(s.latents).shape[0])
                               for s in states])
        cond = Conditioning.cat([prepared(s.cond) for s in states])
        guidance = torch.cat([prepared(s.guidance) for s in states])
        scales = torch.cat([prepared(s.cfg_scale) for s in states])
        return self.guided_prediction(latents, timesteps, cond, guidance, layout, scales)

    @staticmethod
    def split_predictions(noise_pred: torch.Tensor,
                          states: list[StepRequestState]) -> list[torch.Tensor]:
        """Each state's rows, cut back to its own tokens (a padded call's rows
        are as long as the longest; an edit's input-image tokens are not
        predicted for)."""
        shapes = [prepared(s.latents).shape for s in states]
        parts = noise_pred.split([shape[0] for shape in shapes], dim=0)
        return [part if part.shape == shape else part[:, :shape[1]]
                for part, shape in zip(parts, shapes, strict=True)]

    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        latents, timesteps = prepared(state.latents), prepared(state.timesteps)
        t = timesteps[state.step]
        noise_scheduler = prepared(state.noise_scheduler)
        inpaint = state.inpaint
        if state.preview_steps is None:
            state.preview_steps = tuple(state.request.sampling_params.preview_steps())
        if state.step + 1 in state.preview_steps:
            # flow matching: x_t = (1 - sigma) x0 + sigma noise and the model
            # predicts noise - x0, so x0 = x_t - sigma * prediction (the
            # schedule's index: an image-to-image request began at start_step)
            sigma = noise_scheduler.sigmas[state.start_step + state.step].to(latents.dtype)
            x0 = latents - sigma * noise_pred
            if inpaint is not None:  # outside the mask the image is kept
                x0 = inpaint.keep_outside(x0, inpaint.image_latents)
            state.x0 = x0
        rollout = state.rollout
        if rollout is not None and rollout.noise_level is not None:  # flow-sde
            state.latents = rollout.step(self.host.latents, state.request.sampling_params,
                                         noise_scheduler.sigmas, state.start_step + state.step,
                                         latents, noise_pred)
        else:
            state.latents = noise_scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if rollout is not None:
            rollout.record(state.latents, self.unpacker(state.request.sampling_params))
        if inpaint is not None:
            self.conditioner.blend_masked(state, inpaint)
        if state.cache is not None:  # its decision of this step becomes its own
            state.cache.commit()
        state.step += 1

    def guided_prediction(self, latents: torch.Tensor, timesteps: torch.Tensor,
                          cond: Conditioning, guidance: torch.Tensor, layout: RowLayout,
                          cfg_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The transformer call with CFG combined per row (uncond + s * (cond -
        uncond), ``s`` from ``cfg_scale``); ``guidance`` is the families'
        embedded input. Under CFG parallelism each rank computes one branch
        (or, without branches, its share of the rows) and they are gathered."""
        host = self.host
        call, group = host.run_transformer, host.cfg_parallel_group
        if cond.neg_embeds is None:
            if group is not None:  # no branches: the rows are shared out
                from diffrt.engine.parallel.cfg import gather_rows, rows_here

                rows = latents.shape[0]
                mine = rows_here(rows, group)
                # this rank's rows as long as their own longest (a padded step's
                # rows are the whole step's longest), padded back before the gather
                sub = layout.rows(mine)
                pred = call(latents[mine][:, :sub.longest], timesteps[mine], cond.embeds[mine],
                            cond.extra[mine], guidance[mine], sub)
                if pred.shape[1] != latents.shape[1]:
                    pred = pad_tokens([pred], latents.shape[1])
                return gather_rows(pred, rows, group)
            return call(latents, timesteps, cond.embeds, cond.extra, guidance, layout)
        neg_embeds, neg_extra = cond.neg_embeds, prepared(cond.neg_extra)
        scale = cfg_scale if cfg_scale is not None else guidance
        if group is not None:  # one branch here, the other on the peer
            from diffrt.engine.parallel.cfg import cfg_branch, gather_branches

            conditional = cfg_branch(group)
            pred = call(latents, timesteps, cond.embeds if conditional else neg_embeds,
                        cond.extra if conditional else neg_extra, guidance, layout)
            return host.combine_guidance(*gather_branches(pred, group), scale)
        pred = call(torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                    cat_rows([neg_embeds, cond.embeds]), cat_rows([neg_extra, cond.extra]),
                    torch.cat([guidance, guidance]), layout + layout)
        uncond, text = pred.chunk(2)
        return host.combine_guidance(text, uncond, scale)

    # -- step caches -----------------------------------------------------------------
    @property
    def caches_here(self) -> bool:
        """Step caches run on this worker: one rank holds each request's rows
        whole (a CFG-parallel or sequence-parallel split would need every
        rank to agree on each decision; the engine refuses such requests)."""
        return self.host.cfg_parallel_group is None and self.host.sequence_split is None

    def new_cache(self, state: StepRequestState) -> RequestCache | None:
        """The step cache a prepared request runs with (None: none)."""
        host = self.host
        plan = host.spec.cache_plan(state.request.sampling_params)
        if plan is None or not self.caches_here:
            return None
        if host.cache_budget is None:
            host.cache_budget = CacheBudget(DEFAULT_CACHE_STATE_BYTES)
        return RequestCache(plan, state.total_steps, host.cache_budget, state.request_id)

    @staticmethod
    def running_cache(state: StepRequestState) -> RequestCache | None:
        cache = state.cache
        return cache if cache is not None and cache.active else None

    def end_cache(self, state: StepRequestState) -> None:
        """A finished request's cache: its metrics kept for the reply, its state freed."""
        if state.cache is not None:
            self.cache_metrics[state.request_id] = state.cache.metrics()
            state.cache.free()

    def take_cache_metrics(self) -> dict[str, CacheMetrics]:
        metrics, self.cache_metrics = self.cache_metrics, {}
        return metrics

    # -- decode ----------------------------------------------------------------------
    def finish(self, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """What the request asked for: decoded images, or (N, C, h, w) latents."""
        host = self.host
        if params.output_type == "latent":
            return host.latents.unpack(latents, host.latents.size(params))
        return host.decode_latents(latents, params)

    def decode_preview(self, state: StepRequestState) -> torch.Tensor | None:
        x0, state.x0 = state.x0, None
        if x0 is None:
            return None
        return self.conditioner.restore_unmasked(
            state, self.finish(x0, state.request.sampling_params))

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        return self.conditioner.restore_unmasked(
            state, self.finish(prepared(state.latents), state.request.sampling_params))

    def post_decode_batch(self, states: list[StepRequestState],
                          post_decode: Callable[[StepRequestState], torch.Tensor]
                          ) -> list[RequestOutput]:
        """One VAE decode for requests finishing in the same tick (as forward
        does); ``post_decode`` (the pipeline's) decodes a request alone."""
        for state in states:
            self.end_cache(state)
        return [with_rollout(state, out) for state, out in
                zip(states, self.decode_all(states, post_decode), strict=True)]

    def decode_all(self, states: list[StepRequestState],
                   post_decode: Callable[[StepRequestState], torch.Tensor]
                   ) -> list[torch.Tensor]:
        if len(states) == 1:
            return [post_decode(states[0])]
        groups: dict[tuple, list[int]] = {}  # decoded together: same size and output
        for i, s in enumerate(states):
            params = s.request.sampling_params
            alone = i if params.deterministic else None  # batch invariance: decoded alone
            groups.setdefault((self.host.latents.size(params), params.output_type, alone),
                              []).append(i)
        out: dict[int, torch.Tensor] = {}
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = post_decode(states[members[0]])
                continue
            params = states[members[0]].request.sampling_params
            latents = torch.cat([prepared(states[i].latents) for i in members])
            parts = self.finish(latents, params).split(
                [states[i].request.sampling_params.num_outputs_per_prompt for i in members])
            for i, part in zip(members, parts, strict=True):
                # each request's tensor owns its storage
                out[i] = self.conditioner.restore_unmasked(states[i], part).clone()
        return [out[i] for i in range(len(states))]


def with_rollout(state: StepRequestState, out: torch.Tensor) -> RequestOutput:
    """A finished request's output: its images, and beside them what it
    recorded of its steps when it asked (``flow_sde.RowNoise.result``)."""
    rollout = state.rollout
    if rollout is None or not rollout.wanted:
        return out
    return {"images": out, "rollout": rollout.result()}


__all__ = ["DenoiseLoop", "check_compatible", "prepared", "with_rollout"]
