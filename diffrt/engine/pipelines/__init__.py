"""Pipeline contract, the model families and loading a resolved model.

Each family lives in one package (``flux/``, ``sd3/``, ``qwen_image/``: its
spec, its pipeline, its parallel attention); ``load.load_pipeline`` loads the
pipeline a resolved ``ModelSpec`` names. Model folders, names and the
registry are the room below (``engine.models``); its public names are
re-exported here for the families and plugins that register with it.
Importing this package does not import diffusers: families are imported on
first use, and diffusers only when weights are built.
"""

from diffrt.engine.models.family import Family, ModelFolder
from diffrt.engine.models.registry import (
    UnknownModelError,
    families,
    known_models,
    register_family,
    register_model,
    resolve_model_spec,
    unregister_model,
)
from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.pipelines.load import load_pipeline

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
