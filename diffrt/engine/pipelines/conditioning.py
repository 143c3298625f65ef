"""What a request is conditioned on, prepared once at admission: its prompt
embeddings, its input images' latents, and for image-to-image and
inpainting where its schedule starts and what each step blends back.

``Conditioner`` runs these stages for the denoise loop (``denoise.py``)
through the family's encoders (``contract.FlowMatchHost``): the text
encoder, called once for all prompts admitted together; the VAE's encoder,
once per input-image size. Its results land in the request's typed state
(``StepRequestState.cond``, ``start_step``, ``inpaint``, ``overlay``, and
the family's ``condition_on_images`` for an edit).
"""

from __future__ import annotations

from collections import Counter

import torch

from diffrt.engine.input_images import InputPixels, read_pixels
from diffrt.engine.pipelines.contract import FlowMatchHost
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.pipelines.request_state import Conditioning, Inpaint, Overlay
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams, random_seed


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


class Conditioner:
    """The conditioning stages of one pipeline (see the module)."""

    def __init__(self, host: FlowMatchHost):
        self.host = host
        #: request id -> text encoder -> tokens it cut, since ``take_prompt_cuts``
        self.prompt_cuts: dict[str, dict[str, int]] = {}

    def take_prompt_cuts(self) -> dict[str, dict[str, int]]:
        cuts, self.prompt_cuts = self.prompt_cuts, {}
        return cuts

    # -- prompts ----------------------------------------------------------------------
    def encode_prompts(self, requests: list[DiffusionRequest],
                       inputs: list[InputPixels | None] | None = None) -> list[Conditioning]:
        """Each request's embeddings, repeated per output, negatives when CFG
        runs, from one text-encoder call (each prompt's embedding does not
        depend on the others: fixed lengths); edits whose text encoder sees
        their image (``text_sees_images``) one by one."""
        host = self.host
        seen = {i: pixels for i, (r, pixels) in enumerate(zip(requests, inputs or [None] * len(
            requests), strict=True)) if host.text_sees_images and pixels is not None
            and host.spec.task_of(r) == "editing"}
        rest = [i for i in range(len(requests)) if i not in seen]
        alone = [i for i in rest if requests[i].sampling_params.deterministic]  # batch invariant
        shared = [i for i in rest if i not in alone]
        texts = dict(zip(shared, self._encode_texts([requests[i] for i in shared]) if shared
                         else [], strict=True))
        texts.update({i: self._encode_texts([requests[i]])[0] for i in alone})
        return [host.encode_with_images(requests[i], seen[i]) if i in seen else texts[i]
                for i in range(len(requests))]

    def _encode_texts(self, requests: list[DiffusionRequest]) -> list[Conditioning]:
        host = self.host
        texts: list[str] = []
        for request in requests:
            texts.append(request.prompt)
            if host.spec.uses_cfg(request):
                texts.append(host.spec.negative_prompt(request) or "")
        embeds, extra = host.text_encoder(texts)
        self._count_cuts(requests)
        embeds, extra = embeds.to(host.device, host.dtype), extra.to(host.device, host.dtype)
        out, row = [], 0
        for request in requests:
            n = request.sampling_params.num_outputs_per_prompt
            e = embeds[row:row + 1].repeat_interleave(n, 0)
            x = extra[row:row + 1].repeat_interleave(n, 0)
            row += 1
            if not host.spec.uses_cfg(request):
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
        counter = getattr(self.host.text_encoder, "tokens_dropped", None)
        if counter is None:
            return
        spec = self.host.spec
        for request in requests:
            cuts = Counter(counter(request.prompt))
            if spec.uses_cfg(request):
                cuts.update(counter(spec.negative_prompt(request) or ""))
            if cuts:
                self.prompt_cuts[request.request_id] = dict(cuts)

    # -- input images -----------------------------------------------------------------
    def input_pixels(self, state: StepRequestState) -> InputPixels | None:
        """The state's input images (read by the runner, or converted here)."""
        if state.inputs is None and state.request.images:
            request, spec = state.request, self.host.spec
            state.inputs = read_pixels(request, None,
                                       lambda w, h: spec.input_size(request, w, h),
                                       spec.prompt_image_size(request))
        return state.inputs

    def encode_inputs(self, states: list[StepRequestState],
                      generators: list[torch.Generator]
                      ) -> tuple[dict[int, list[torch.Tensor]], set[int]]:
        """The input images' latents of the states that have any, by state
        index, and which of them are edits. Image-to-image and inpainting:
        one image, sampled with the request's own generator; an edit: every
        input image, the distribution's mode."""
        pixels = {i: p for i, s in enumerate(states) if (p := self.input_pixels(s)) is not None}
        edits = {i for i in pixels if self.host.spec.task_of(states[i].request) == "editing"}
        sampled = [i for i in pixels if i not in edits]
        image_latents: dict[int, list[torch.Tensor]] = {}
        if sampled:
            for i, latents in zip(sampled, self.encode_images(
                    [to_model_pixels(pixels[i].images[0]) for i in sampled],
                    [generators[i] for i in sampled]), strict=True):
                image_latents[i] = [latents]
        owners = [(i, image) for i in sorted(edits) for image in pixels[i].images]
        if owners:
            for (i, _), latents in zip(owners, self.encode_images(
                    [to_model_pixels(image) for _, image in owners], None), strict=True):
                image_latents.setdefault(i, []).append(latents)
        return image_latents, edits

    def encode_images(self, pixels: list[torch.Tensor],
                      generators: list[torch.Generator] | None) -> list[torch.Tensor]:
        """Each input image ((1, 3, H, W)) -> its (1, C, h, w) latents, one VAE
        call per image size; each sample is drawn from its request's own
        generator, as ``retrieve_latents`` draws it (no ``generators``: the
        distribution's mode, ``sample_mode="argmax"``, as an editing
        pipeline encodes its input)."""
        host = self.host
        out: dict[int, torch.Tensor] = {}
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            groups.setdefault(tuple(p.shape), []).append(i)
        for members in groups.values():
            batch = torch.cat([pixels[i] for i in members]).to(host.device, host.dtype)
            dist = host.encode_image_dist(batch)
            for row, i in enumerate(members):
                mean, std = dist.mean[row:row + 1], dist.std[row:row + 1]
                if generators is None:
                    out[i] = host.normalize_image_latents(mean)
                    continue
                sample = torch.randn(mean.shape, generator=generators[i], dtype=torch.float32)
                out[i] = host.normalize_image_latents(
                    mean + std * sample.to(mean.device, mean.dtype))
        return [out[i] for i in range(len(pixels))]

    # -- image-to-image and inpainting -------------------------------------------------
    def start_from_image(self, state: StepRequestState, image_latents: torch.Tensor,
                         generator: torch.Generator) -> None:
        """Image-to-image: the schedule from ``start_step`` on, and first
        latents that are the image noised to that step (``scale_noise``), as
        the family's diffusers img2img / inpaint pipeline prepares them; with
        a mask, what each step's blend and the decode need."""
        host, params = self.host, state.request.sampling_params
        assert state.timesteps is not None and state.inputs is not None  # prepared, with its image
        assert state.noise_scheduler is not None
        start = params.start_step()
        noise_scheduler = state.noise_scheduler
        noise_scheduler.set_begin_index(start)  # diffusers' get_timesteps (order 1)
        state.timesteps = state.timesteps[start:]
        state.start_step = start
        n = params.num_outputs_per_prompt
        noise = host.latents.noise(params, generator).to(host.device, host.dtype)
        image_latents = torch.cat([image_latents] * n) if n > 1 else image_latents
        first = noise_scheduler.scale_noise(image_latents, state.timesteps[:1].repeat(n), noise)
        pack = host.latents.pack
        state.latents = pack(first)
        mask = state.inputs.mask
        if mask is not None:
            state.inpaint = Inpaint(pack(self.latent_mask(mask, params)), pack(image_latents),
                                    pack(noise))
            state.overlay = Overlay(binarized(mask)[None, None].to(host.device, host.dtype),
                                    to_model_pixels(state.inputs.images[0]).to(
                                        host.device, host.dtype))

    def latent_mask(self, mask: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """A (H, W) uint8 mask -> (N, C, h, w) of 0 and 1 at the latents' size,
        as diffusers' mask processor and ``prepare_mask_latents`` make it
        (binarised at one half, nearest-neighbour down to the latents)."""
        host = self.host
        m = torch.nn.functional.interpolate(binarized(mask)[None, None],
                                            size=host.latents.size(params))
        m = m.to(host.device, host.dtype)
        return m.repeat(params.num_outputs_per_prompt, host.latents.channels, 1, 1)

    @staticmethod
    def blend_masked(state: StepRequestState, inpaint: Inpaint) -> None:
        """Inpainting, after each step: outside the mask the latents are the
        input image noised to the next step (the image itself after the last),
        as diffusers' inpaint pipelines blend them."""
        timesteps = state.timesteps
        assert timesteps is not None and state.latents is not None
        assert state.noise_scheduler is not None
        proper = inpaint.image_latents
        if state.step + 1 < len(timesteps):
            proper = state.noise_scheduler.scale_noise(
                inpaint.image_latents, timesteps[state.step + 1:state.step + 2], inpaint.noise)
        state.latents = inpaint.keep_outside(state.latents, proper)

    @staticmethod
    def restore_unmasked(state: StepRequestState, images: torch.Tensor) -> torch.Tensor:
        """Inpainting: outside the mask the input's own pixels, not their VAE
        round trip (which drifts a few levels over the whole picture), as
        diffusers' ``apply_overlay`` pastes them back for a cropped inpaint;
        latents pass as they are."""
        overlay = state.overlay
        if overlay is None or state.request.sampling_params.output_type == "latent":
            return images
        return overlay.paste(images)


__all__ = ["Conditioner", "binarized", "resolve_seed", "to_model_pixels"]
