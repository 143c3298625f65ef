"""Models shipped inside the package: trained folders, loaded exactly as a
user's checkpoint is (model_index.json, the folder's own text encoders and
tokenizers, the family's diffusers pipeline).

``diffrt-shapes`` (the default model) is a tiny Flux trained on synthetic
pictures of shapes by ``scripts/train_demo_model.py``; its folder, with its
model card, is ``diffrt/models/diffrt-shapes``. ``diffrt-motion`` (the
default video model) is a tiny Helios trained on synthetic clips of one
moving shape by ``scripts/train_motion_model.py``: ``diffrt/models/diffrt-motion``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from diffrt.engine.models.folder_check import JsonObject

#: where the package keeps its model folders
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "models")


@dataclass(frozen=True)
class ShippedModel:
    folder: str  # below MODELS_DIR
    #: sampling defaults on top of the family's (what the model was trained for)
    sampling_defaults: JsonObject = field(default_factory=dict)
    #: the negative prompt of a request that names none (see
    #: DiffusionPipeline.default_negative_prompt)
    default_negative_prompt: str | None = None
    #: spec fields on top of the family's description (what the checkpoint
    #: was trained for where its family's default differs: a chunk length)
    spec_overrides: JsonObject = field(default_factory=dict)
    #: the step caches' calibration of this checkpoint, ``CacheSupport`` fields
    #: on top of the family's, as ``EmbeddedModel.cache``
    cache: JsonObject = field(default_factory=dict)


SHIPPED_MODELS: dict[str, ShippedModel] = {
    # 64x64 pictures, 12 steps; not guidance-distilled (guidance_scale is
    # unused) but trained with 10 % empty prompts, and true CFG at 3 against
    # the empty prompt is what makes its shapes sharp (its model card: shape
    # read back from 60 % of held-out pictures without CFG, 97 % with)
    "diffrt-shapes": ShippedModel("diffrt-shapes", {"height": 64, "width": 64,
                                                    "num_inference_steps": 12,
                                                    "guidance_scale": 1.0,
                                                    "true_cfg_scale": 3.0},
                                  default_negative_prompt="",
                                  # first-block 0.25: 47 % of the skippable blocks reused, every
                                  # attribute within 1 of 30 held-out prompts (bench_cache.py,
                                  # 2026-12-02); TeaCache runs on the distance as it is (its
                                  # fitted line explained 2 % of the output's change)
                                  cache={"thresholds": {"first-block": 0.25}}),
    # 9 frames of 64x64, 12 steps, CFG 3 against the empty prompt: what it was
    # trained and measured for (its model card); 8 fps makes the 36 px move a
    # clip of a second, as diffusers' export_to_video plays it. A clip is one
    # chunk of 5 latent frames (diffusers' num_latent_frames_per_chunk=5), the
    # only chunk it was trained on: Helios' default, 9, is 17 frames here
    "diffrt-motion": ShippedModel("diffrt-motion", {"height": 64, "width": 64,
                                                    "num_frames": 9, "fps": 8,
                                                    "num_inference_steps": 12,
                                                    "guidance_scale": 3.0},
                                  default_negative_prompt="",
                                  spec_overrides={"chunk_latent_frames": 5}),
}


def shipped_folder(name: str) -> str:
    return os.path.join(MODELS_DIR, SHIPPED_MODELS[name].folder)


__all__ = ["MODELS_DIR", "SHIPPED_MODELS", "ShippedModel", "shipped_folder"]
