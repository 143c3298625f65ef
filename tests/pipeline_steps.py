"""Running a pipeline's step protocol by hand, as the worker does: what the
pipeline tests compare with its request-mode forward. Imported as ``from
pipeline_steps import stepped`` (pyproject puts tests/ on ``sys.path``)."""

from __future__ import annotations

import torch

from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.request import DiffusionRequest


def stepped(pipe, requests: list[DiffusionRequest]) -> list[torch.Tensor]:
    """``requests`` prepared, denoised one shared step at a time, decoded."""
    states = [StepRequestState(request=r) for r in requests]
    for s in states:
        pipe.prepare_encode(s)
    while not states[0].finished:
        preds = pipe.split_predictions(pipe.denoise_step(states), states)
        for s, p in zip(states, preds, strict=True):
            pipe.apply_step(s, p)
    return pipe.post_decode_batch(states)
