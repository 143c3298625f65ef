"""Pipeline contract, model registry and the model families.

``registry`` resolves a model name to its ``ModelSpec`` (JSON only) and loads
the pipeline it names; each family lives in one package (``flux/``, ``sd3/``,
``qwen_image/``: its spec, its pipeline, its parallel attention). Importing
this package does not import diffusers: families are imported on first use,
and diffusers only when weights are built.
"""

from diffrt.engine.pipelines.family import Family, ModelFolder
from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.pipelines.registry import (
    UnknownModelError,
    families,
    known_models,
    load_pipeline,
    register_family,
    register_model,
    resolve_model_spec,
    unregister_model,
)

__all__ = [
    "DiffusionPipeline",
    "DiffusionRequestBatch",
    "Family",
    "ModelFolder",
    "StepRequestState",
    "UnknownModelError",
    "families",
    "known_models",
    "load_pipeline",
    "register_family",
    "register_model",
    "resolve_model_spec",
    "unregister_model",
]
