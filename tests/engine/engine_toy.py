"""A model-free pipeline for engine tests: instant, deterministic, with faults.

Registered as "toy" (request batching + step protocol), "toy-serial" (neither)
and "toy-hang" (every forward blocks until released). Its image encodes the
request's seed and step count, so a swapped or mixed-up output is visible:
pixel value = (seed * 7 + steps) % 200 / 100 - 1 before quantisation.

Prompts steer faults: "fail" raises in forward / prepare_encode, "failstep"
raises in denoise_step when that request is in the batch, "faildecode" in
post_decode, "oom" raises torch.OutOfMemoryError in forward / denoise_step
and "oom-batched" does so only when batched with another request, "slowsteps"
runs its steps 0.4 s each in forward (reporting each, as a real forward does),
and "block:NAME"
waits (bounded) on ``gate(NAME)`` in forward or denoise_step.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

from diffrt.engine.model_spec import ModelSpec, SamplingDefaults
from diffrt.engine.pipelines import register_model
from diffrt.engine.pipelines.interface import DiffusionPipeline
from diffrt.engine.postprocess import quantize_images

BLOCK_TIMEOUT_S = 30.0
SLOW_STEP_S = 0.4

_gates: dict[str, threading.Event] = defaultdict(threading.Event)
#: what ran, in order: ("forward" | "step" | "decode", [ids])
CALLS: list[tuple[str, list[str]]] = []
_calls_lock = threading.Lock()


def gate(name: str) -> threading.Event:
    return _gates[name]


def open_gates() -> None:
    """Open every gate: whatever a test left blocked runs on."""
    for event in list(_gates.values()):
        event.set()


def reset() -> None:
    with _calls_lock:
        CALLS.clear()


def calls(kind: str) -> list[list[str]]:
    with _calls_lock:
        return [ids for k, ids in CALLS if k == kind]


def pixel_value(seed: int, steps: int) -> float:
    return (seed * 7 + steps) % 200 / 100 - 1


def expected_pixel(seed: int, steps: int) -> int:
    """The uint8 value every pixel of the image for (seed, steps) has."""
    t = torch.full((1, 3, 1, 1), pixel_value(seed, steps))
    return int(quantize_images(t)[0, 0, 0, 0])


def _maybe_block(prompt: str) -> None:
    if prompt.startswith("block:"):
        if not gate(prompt[6:]).wait(BLOCK_TIMEOUT_S):
            raise TimeoutError(f"gate {prompt[6:]!r} never opened")


def _maybe_oom(prompts: list[str]) -> None:
    if "oom" in prompts or ("oom-batched" in prompts and len(prompts) > 1):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (toy)")


def _record(kind: str, ids: list[str]) -> None:
    with _calls_lock:
        CALLS.append((kind, ids))


def toy_spec(name: str, pipeline: str, *, batches: bool = True) -> ModelSpec:
    """A toy's description: 8-px multiples up to 512, 128 px in 4 steps."""
    return ModelSpec(name=name, family="toy", pipeline=f"engine_toy:{pipeline}",
                     size_multiple=8, max_size=512,
                     defaults=SamplingDefaults(height=128, width=128, num_inference_steps=4,
                                               guidance_scale=1.0),
                     supports_request_batch=batches, supports_step_execution=batches)


class ToyPipeline(DiffusionPipeline):
    @classmethod
    def load(cls, spec, *, device, dtype):
        pipeline = cls()
        pipeline.spec = spec
        return pipeline

    def _image(self, request, steps: int) -> torch.Tensor:
        p = request.sampling_params
        seed = p.seed or 0
        return torch.full((p.num_outputs_per_prompt, 3, p.height, p.width), pixel_value(seed, steps))

    def forward(self, batch):
        ids = [r.request_id for r in batch.requests]
        _record("forward", ids)
        _maybe_oom([r.prompt for r in batch.requests])
        for r in batch.requests:
            if r.prompt == "slowsteps":
                for _ in range(r.sampling_params.num_inference_steps):
                    time.sleep(SLOW_STEP_S)
                    self.report_step()
            _maybe_block(r.prompt)
            if r.prompt == "fail":
                raise RuntimeError(f"toy failure in {r.request_id}")
        return [self._image(r, r.sampling_params.num_inference_steps) for r in batch.requests]

    def prepare_encode(self, state):
        if state.request.prompt == "fail":
            raise ValueError("toy failure in prepare_encode")
        n = state.request.sampling_params.num_outputs_per_prompt
        state.latents = torch.zeros(n, 1)
        state.step = 0

    def denoise_step(self, states):
        _record("step", [s.request_id for s in states])
        _maybe_oom([s.request.prompt for s in states])
        for s in states:
            _maybe_block(s.request.prompt)
            if s.request.prompt == "failstep":
                raise RuntimeError(f"toy step failure in {s.request_id}")
        return torch.ones(sum(s.latents.shape[0] for s in states), 1)

    def apply_step(self, state, noise_pred):
        state.latents = state.latents + noise_pred
        state.step += 1

    def post_decode(self, state):
        if state.request.prompt == "faildecode":
            raise RuntimeError(f"toy decode failure in {state.request_id}")
        steps = int(state.latents[0, 0].item())
        return self._image(state.request, steps)

    def post_decode_batch(self, states):
        _record("decode", [s.request_id for s in states])
        return super().post_decode_batch(states)


class HangingToyPipeline(ToyPipeline):

    def forward(self, batch):
        if not gate("hang").wait(BLOCK_TIMEOUT_S):
            raise TimeoutError("hang gate never opened")
        return super().forward(batch)


register_model(toy_spec("toy", "ToyPipeline"))
register_model(toy_spec("toy-serial", "ToyPipeline", batches=False))
register_model(toy_spec("toy-hang", "HangingToyPipeline"))
