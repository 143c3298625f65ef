"""The Wan family's spec, from a folder's configs (no weights, no diffusers).

What diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` do by
default: 480 x 832 px, 81 frames (16 fps, Wan's own), 50 steps, CFG when
``guidance_scale`` > 1 (5.0) with an empty negative prompt, UMT5 prompts
padded to 512 tokens. A clip has ``scale_factor_temporal`` x k + 1 frames;
a side is a multiple of the VAE's factor x the patch (16 px). The features
not yet made to work on video are refused by the spec, each naming its
field (docs/families.md): step caches (``cache``), LoRA (``loras``),
weight quantization (``quantization``), every multi-rank split.
"""

from __future__ import annotations

from diffrt.engine.model_spec import CfgRule, ModelSpec, ParallelSupport, SamplingDefaults
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.pipelines.flow_match_spec import attention_width, check_text_encoder
from diffrt.engine.pipelines.wan.latents import TEXT_TOKENS

#: Wan's frame rate (its released clips play at 16 fps)
WAN_FPS = 16.0
#: the most frames a request may ask (the rotary table's frame positions
#: bound it lower for a model with a shorter one)
MAX_FRAMES = 257


def describe(folder: ModelFolder) -> ModelSpec:
    """WanPipeline's (or, for an image-to-video folder, WanImageToVideoPipeline's)
    semantics; see the module."""
    check_text_encoder(folder)
    config, vae = folder.transformer_config, folder.vae_config
    spatial = int(vae.get("scale_factor_spatial", 8))
    temporal = int(vae.get("scale_factor_temporal", 4))
    patch = config.get("patch_size", (1, 2, 2))
    assert isinstance(patch, list | tuple)
    rope = int(config.get("rope_max_seq_len", 1024))  # positions per axis
    i2v = folder.index.get("_class_name") == "WanImageToVideoPipeline"
    multiple = spatial * int(patch[1])
    return ModelSpec(
        name=folder.name, family="wan", pipeline="diffrt.engine.pipelines.wan.pipeline:WanPipeline",
        diffusers_pipeline="WanImageToVideoPipeline" if i2v else "WanPipeline",
        folder=folder.path,
        # image-to-video: the first frame in the clip's place, at the clip's size
        tasks=("editing",) if i2v else ("text-to-image",), max_input_images=1 if i2v else 0,
        edit_resize="output",
        size_multiple=multiple, max_size=min(2048, rope * multiple),
        frame_factor=temporal, max_frames=min(MAX_FRAMES, (rope - 1) * temporal + 1),
        defaults=SamplingDefaults(height=480, width=832, num_inference_steps=50,
                                  guidance_scale=5.0, num_frames=81, fps=WAN_FPS),
        cfg_rule=CfgRule.GUIDANCE_GT_1,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        parallel=ParallelSupport(), transformer_width=attention_width(folder),
        text_tokens=TEXT_TOKENS)


__all__ = ["MAX_FRAMES", "WAN_FPS", "describe"]
