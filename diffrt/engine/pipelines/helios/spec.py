"""The Helios family's spec, from a folder's configs (no weights, no diffusers).

What diffusers' ``HeliosPipeline`` does by default: 384 x 640 px, 132
frames asked (129 made: four chunks of 33, cut to 4k + 1), 50 steps per
chunk, CFG when ``guidance_scale`` > 1 (5.0) with an empty negative prompt,
UMT5 prompts padded to 512 tokens, chunks of 9 latent frames with a history
of (16, 2, 1) latent frames. Played at 24 fps (diffusers' example exports
at 24). A request asks a frame count whole chunks give
(``engine.video_chunks``). Text-to-video only; what the family does not
run is refused by the spec, each naming its field (docs/families.md): input
images (``images``), LoRA (``loras``: no target modules), step caches
(``cache``), lower-precision weights (``quantization``), every multi-rank
split, and ``partial_images`` (the chunks are the previews). A folder
whose scheduler is not Helios-Base's one-stage UniPC (the pyramid and
distilled variants) is refused at load.
"""

from __future__ import annotations

import os

from diffrt.engine.model_spec import CfgRule, ModelSpec, ParallelSupport, SamplingDefaults
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.models.folder_check import ModelLoadError, read_json_object
from diffrt.engine.pipelines.flow_match_spec import attention_width, tokenizer_max_length
from diffrt.engine.pipelines.wan.latents import TEXT_TOKENS
from diffrt.engine.pipelines.wan.spec import video_geometry
from diffrt.engine.sampling import MAX_FRAMES

#: Helios' frame rate (diffusers' example exports its clips at 24 fps)
HELIOS_FPS = 24.0
#: HeliosPipeline's ``num_latent_frames_per_chunk`` default (its
#: ``history_sizes``: ``history.HISTORY_SIZES``)
CHUNK_LATENT_FRAMES = 9
#: what the history adds to a call's tokens, in latent frames' worth: the
#: short history and its prefix at full resolution (2), the mid 2 frames
#: patched 2x finer in time and space (2 / 8) and the long 16 at 4x (16 / 64)
HISTORY_TOKEN_FRAMES = 3


def check_scheduler(folder: ModelFolder) -> None:
    """Helios-Base's one-stage UniPC schedule only: a pyramid (``stages`` >
    1) or distilled (``dmd``) folder's schedule is not run yet."""
    path = os.path.join(folder.path, "scheduler", "scheduler_config.json")
    config = read_json_object(path) if os.path.isfile(path) else {}
    stages, kind = config.get("stages", 1), config.get("scheduler_type", "unipc")
    if stages != 1 or kind != "unipc":
        raise ModelLoadError(f"{path}: {folder.name} has a {stages}-stage {kind} HeliosScheduler; "
                             "the helios family runs Helios-Base's 1-stage unipc one only")


def describe(folder: ModelFolder) -> ModelSpec:
    """HeliosPipeline's semantics; see the module."""
    check_scheduler(folder)
    _, temporal, multiple = video_geometry(folder)
    return ModelSpec(
        name=folder.name, family="helios",
        pipeline="diffrt.engine.pipelines.helios.pipeline:HeliosPipeline",
        diffusers_pipeline="HeliosPipeline", folder=folder.path,
        tasks=("text-to-image",), max_input_images=0,
        size_multiple=multiple, max_size=2048,
        frame_factor=temporal, max_frames=MAX_FRAMES,
        chunk_latent_frames=CHUNK_LATENT_FRAMES, history_latent_frames=HISTORY_TOKEN_FRAMES,
        defaults=SamplingDefaults(height=384, width=640, num_inference_steps=50,
                                  guidance_scale=5.0, num_frames=129, fps=HELIOS_FPS),
        cfg_rule=CfgRule.GUIDANCE_GT_1,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        parallel=ParallelSupport(),
        transformer_width=attention_width(folder),
        text_tokens=tokenizer_max_length(folder, "tokenizer", TEXT_TOKENS))


__all__ = ["CHUNK_LATENT_FRAMES", "HELIOS_FPS", "check_scheduler", "describe"]
