"""A resolved model's pipeline, loaded: the one step from a ``ModelSpec``
(``engine.models``, JSON only) to weights on a device."""

from __future__ import annotations

import logging

import torch

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.models.family import load_object
from diffrt.engine.models.folder_check import ModelLoadError
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines.interface import DiffusionPipeline

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")


def load_pipeline(
    model: str | ModelSpec,
    *,
    device: torch.device | str = CPU,
    dtype: torch.dtype = torch.float32,
) -> DiffusionPipeline:
    """Load the pipeline for ``model`` (a name or its resolved spec) onto ``device``."""
    spec = model if isinstance(model, ModelSpec) else resolve_model_spec(model)
    try:
        cls = load_object(spec.pipeline)
        pipeline = cls.load(spec, device=torch.device(device), dtype=dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # one line for the user; the traceback stays in the log
        logger.debug("loading %s failed", spec.name, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(f"{spec.name}: cannot load ({type(exc).__name__}: {first})") from exc
    logger.info("loaded pipeline %s on %s (%s)", spec.name, device, dtype)
    return pipeline
