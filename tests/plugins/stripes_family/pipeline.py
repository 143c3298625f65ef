"""The stripes family's pipeline: compute only (what a request may ask is
its spec's)."""

from __future__ import annotations

import os
import zlib

import torch
from safetensors.torch import load_file

from diffrt.engine.pipelines import DiffusionPipeline, DiffusionRequestBatch, StepRequestState


class StripesPipeline(DiffusionPipeline):
    """Horizontal stripes: row r of a request's image after k steps is
    ``colour * (seed and prompt's tone) * (-1)^((r // stripe + k) % 2)``."""

    def __init__(self, colour: torch.Tensor, stripe: int):
        self.colour = colour
        self.stripe = stripe

    @classmethod
    def load(cls, spec, *, device, dtype):
        weights = load_file(os.path.join(spec.folder, "painter", "painter.safetensors"))
        pipeline = cls(weights["colour"].to(device), spec.size_multiple)
        pipeline.spec, pipeline.device, pipeline.dtype = spec, device, dtype
        return pipeline

    def _tone(self, request) -> float:
        seed = request.sampling_params.seed or 0
        return ((zlib.crc32(request.prompt.encode()) + 7 * seed) % 100) / 100

    def _paint(self, request, steps: int) -> torch.Tensor:
        p = request.sampling_params
        rows = torch.arange(p.height, device=self.device) // self.stripe
        sign = 1 - 2 * ((rows + steps) % 2)
        image = self.colour.view(3, 1, 1) * self._tone(request) * sign.view(1, -1, 1)
        return image.expand(p.num_outputs_per_prompt, 3, p.height, p.width).clone()

    def forward(self, batch: DiffusionRequestBatch) -> list[torch.Tensor]:
        requests = [self.prepared(r) for r in batch.requests]
        for _ in range(requests[0].sampling_params.num_inference_steps):
            self.report_step()
        return [self._paint(r, r.sampling_params.num_inference_steps) for r in requests]

    def prepare_encode(self, state: StepRequestState) -> None:
        state.request = self.prepared(state.request)
        state.latents = torch.zeros(state.request.sampling_params.num_outputs_per_prompt, 1)
        state.step = 0

    def denoise_step(self, states: list[StepRequestState]) -> torch.Tensor:
        return torch.ones(sum(s.latents.shape[0] for s in states), 1)

    def apply_step(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        state.latents = state.latents + noise_pred
        state.step += 1

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        return self._paint(state.request, int(state.latents[0, 0].item()))
