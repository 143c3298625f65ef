"""Pipeline contract, registry and the reference text-to-image pipelines.

Importing this package does not import diffusers: pipeline classes are
resolved lazily, and diffusers is imported only when weights are built.
"""

from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.pipelines.registry import (
    UnknownModelError,
    get_post_process_func,
    get_pre_process_func,
    known_models,
    load_pipeline,
    register_family,
    register_pipeline,
    resolve_pipeline_class,
)

__all__ = [
    "DiffusionPipeline",
    "DiffusionRequestBatch",
    "StepRequestState",
    "UnknownModelError",
    "get_post_process_func",
    "get_pre_process_func",
    "known_models",
    "load_pipeline",
    "register_family",
    "register_pipeline",
    "resolve_pipeline_class",
]
