"""A request's rollout over HTTP (docs/rollouts.md): its log-probs and
trajectory (``return_log_probs``, ``return_trajectory``) as one safetensors
file, kept for ``GET /v1/rollouts/{id}`` beside the images, never as JSON
numbers (a trajectory is megabytes of latents, and a trainer wants them
bit for bit).

The store is the url image store's (``images.ImageStore``), bounded by
``rollout_max_bytes`` and ``rollout_ttl_s``: room is taken when the
request arrives, at its largest size (``estimate_bytes``), so a request that
does not fit is refused before it runs (429 with Retry-After) and an
unexpired rollout is never evicted; its real size replaces the estimate once
it is made. A trajectory's latents are estimated at the model's
``output_bytes_per_pixel`` (what the engine sizes its output arena by: at
least 3 bytes a pixel, six times a Flux latent's in bf16) until the store has
seen one, then at the bytes a pixel that one measured (a model's latents
keep their layout and dtype), so the room taken is what a file takes. A rollout is its API key's (``owner``, as a video job is, when
the server has several keys): another key finds nothing (404).

One file per request (a GRPO group is one request with ``n`` seeds): row
``i`` of ``log_probs`` and ``latents`` is the response's ``data[i]``; the
file's metadata says the weights version, the seeds, the prompt and the
sampler it ran with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from diffrt.engine import DiffusionOutput, DiffusionRequest
from diffrt.engine.model_spec import ModelSpec
from diffrt.serve.errors import ApiError
from diffrt.serve.images import ImageStore, Reservation, StoreFull, served_url
from diffrt.serve.protocol import RolloutRef

#: the most rollouts kept at once (the bound that matters is the bytes')
MAX_ROLLOUTS = 4096
MEDIA_TYPE = "application/octet-stream"
#: what a file takes beyond its tensors and prompt: the safetensors header
HEADER_BYTES = 16 << 10
#: the steps and side assumed when the model's defaults cannot be read here
#: (a Ray Serve ingress without the model's folder)
FALLBACK_STEPS, FALLBACK_SIDE = 50, 1024
#: the version of the file's layout (its metadata's ``format``)
FILE_FORMAT = "diffrt-rollout/1"


class RolloutStore(ImageStore):
    """The rollouts kept for download: at most ``max_bytes``, each for ``ttl_s``."""

    def __init__(self, *, ttl_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(ttl_s=ttl_s, max_images=MAX_ROLLOUTS, max_bytes=max_bytes, clock=clock)
        #: a latent's bytes per output pixel, as the last trajectory measured
        #: (None: none seen yet)
        self.latent_bytes_per_pixel: float | None = None

    def observe(self, out: DiffusionOutput) -> None:
        """Learn a latent's bytes per pixel from a trajectory that came back."""
        rollout = out.rollout
        if rollout is None or rollout.latents is None or not out.images:
            return
        width, height = out.images[0].size
        latents = rollout.latents.shape[0] * rollout.latents.shape[1]
        self.latent_bytes_per_pixel = rollout.latents.nbytes / (latents * width * height)

    def _too_large_message(self, count: int, bytes_each: int) -> str:
        return (f"the rollout would take up to {bytes_each} bytes, more than the server keeps "
                f"({self.max_bytes} bytes, --rollout-max-bytes): fewer steps, outputs or "
                "pixels, or no trajectory")

    def _full_message_locked(self) -> str:
        return (f"the rollout store is full ({len(self._items)} rollouts, {self._bytes} bytes "
                f"kept, {self._reserved_images} being made; at most {self.max_bytes} bytes): "
                "download (and DELETE) earlier ones, or retry later")


def asks_rollout(request: DiffusionRequest) -> bool:
    params = request.sampling_params
    return params.return_log_probs or params.return_trajectory


def estimate_bytes(spec: ModelSpec | None, request: DiffusionRequest,
                   latent_bytes_per_pixel: float | None = None) -> int:
    """The most bytes ``request``'s rollout file may take: its trajectory at
    ``latent_bytes_per_pixel`` (as measured; None: the model's
    ``output_bytes_per_pixel``, an upper bound), its log-probs, the
    schedule, the prompt and the header."""
    if spec is not None and not request.images:  # an edit's rollout: refused by the engine
        request = spec.with_defaults(request)
    params = request.sampling_params
    n = params.num_outputs_per_prompt
    steps = params.num_inference_steps or FALLBACK_STEPS
    total = HEADER_BYTES + 4 * len(request.prompt) + 4 * (2 * steps + 1)
    if params.return_log_probs:
        total += 4 * n * steps
    if params.return_trajectory:
        per_pixel = latent_bytes_per_pixel or (3.0 if spec is None
                                               else spec.output_bytes_per_pixel)
        height, width = params.height or FALLBACK_SIDE, params.width or FALLBACK_SIDE
        total += int(per_pixel * height * width * n * (steps + 1))
    return total


def rollout_file(out: DiffusionOutput, request: DiffusionRequest) -> tuple[bytes, list[str]]:
    """``out``'s rollout as safetensors bytes (``safetensors.torch.save``), and
    its tensors' names."""
    from safetensors.torch import save

    rollout = out.rollout
    assert rollout is not None
    tensors = {"timesteps": rollout.timesteps, "sigmas": rollout.sigmas,
               "log_probs": rollout.log_probs, "latents": rollout.latents}
    own = {name: _owned(t) for name, t in tensors.items() if t is not None}
    return save(own, metadata=_metadata(out, request)), sorted(own)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with a storage of its own (safetensors refuses
    tensors that share one, as views of one buffer would)."""
    tensor = tensor.detach().cpu()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.contiguous().clone()


def _metadata(out: DiffusionOutput, request: DiffusionRequest) -> dict[str, str]:
    """The file's metadata (text, as safetensors keeps it; JSON for what is
    not a string): what a trainer needs to reproduce or attribute a row."""
    params = request.sampling_params
    noise = params.effective_noise_level if params.sampler == "flow-sde" else None
    doc: dict[str, Any] = {
        "format": FILE_FORMAT, "request_id": out.request_id, "prompt": request.prompt,
        "negative_prompt": request.negative_prompt, "outputs": params.num_outputs_per_prompt,
        "seed": out.seed, "seeds": out.seeds, "weights_version": out.weights_version,
        "lora_versions": out.lora_versions, "loras": params.loras, "sampler": params.sampler,
        "noise_level": noise, "num_inference_steps": out.total_steps}
    return {key: value if isinstance(value, str) and key != "weights_version"
            else json.dumps(value) for key, value in doc.items()}


class RolloutRoom:
    """Room in the store for one request's rollout, taken at its arrival;
    ``keep`` fills it with the final output's file, ``release`` gives back
    what was not filled."""

    def __init__(self, reservation: Reservation, http_request: Any,
                 engine_request: DiffusionRequest):
        self.reservation = reservation
        self.http_request = http_request
        self.engine_request = engine_request

    async def keep(self, out: DiffusionOutput) -> RolloutRef:
        """Encode ``out``'s rollout (off the event loop) and keep it; where it is."""
        if out.rollout is None:
            raise ApiError(500, "the engine's output carries no rollout although the request "
                                "asked for one")
        data, names = await asyncio.to_thread(rollout_file, out, self.engine_request)
        rollout_id = self.reservation.put(data, MEDIA_TYPE)
        store = self.reservation.store
        assert isinstance(store, RolloutStore)
        store.observe(out)
        ttl = store.ttl_s
        return RolloutRef(
            id=rollout_id, bytes=len(data), weights_version=out.weights_version, tensors=names,
            url=served_url(self.http_request, "rollout_content", rollout_id=rollout_id),
            expires_at=int(time.time() + ttl))

    def release(self) -> None:
        self.reservation.release()


def reserve_rollout(http_request: Any, engine_request: DiffusionRequest,
                    spec: ModelSpec | None) -> RolloutRoom | None:
    """Room for ``engine_request``'s rollout when it asks for one: 429 (with
    Retry-After) while the store is full, 400 naming the field when even an
    empty store is too small."""
    if not asks_rollout(engine_request):
        return None
    store: RolloutStore = http_request.app.state.rollouts
    owner = getattr(http_request.state, "owner", None)
    try:
        need = estimate_bytes(spec, engine_request, store.latent_bytes_per_pixel)
        reservation = store.reserve(1, need, owner=owner)
    except StoreFull as exc:
        raise ApiError(429, str(exc), code="rollout_store_full",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    except ValueError as exc:
        field = ("return_trajectory" if engine_request.sampling_params.return_trajectory
                 else "return_log_probs")
        raise ApiError(400, f"{field}: {exc}", param=field, code="invalid_value") from None
    return RolloutRoom(reservation, http_request, engine_request)


__all__ = ["MEDIA_TYPE", "RolloutRoom", "RolloutStore", "asks_rollout", "estimate_bytes",
           "reserve_rollout", "rollout_file"]
