"""The stripes family's ModelSpec, from a folder's configs (JSON only)."""

from __future__ import annotations

import os

from diffrt.engine.model_spec import CfgRule, ModelSpec, SamplingDefaults
from diffrt.engine.models.folder_check import ModelLoadError, read_json_object
from diffrt.engine.pipelines import ModelFolder


def describe(folder: ModelFolder) -> ModelSpec:
    """Sizes in multiples of the painter's stripe height, up to its
    ``max_size``; 3 steps; no CFG; batches in both modes."""
    config_path = os.path.join(folder.path, "painter", "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{config_path}: missing (a stripes folder has a painter)")
    config = read_json_object(config_path)
    stripe = int(config["stripe_height"])
    return ModelSpec(
        name=folder.name, family="stripes", pipeline="plugins.stripes_family.pipeline:StripesPipeline",
        diffusers_pipeline="StripesPipeline", folder=folder.path,
        size_multiple=stripe, max_size=int(config["max_size"]),
        defaults=SamplingDefaults(height=4 * stripe, width=4 * stripe, num_inference_steps=3,
                                  guidance_scale=1.0),
        cfg_rule=CfgRule.NEVER, supports_request_batch=True, supports_step_execution=True)
