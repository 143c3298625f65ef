"""The LTX-2 family's spec, from a folder's configs (no weights, no diffusers).

What diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` do by
default: 512 x 768 px, 121 frames at 24 fps, 30 steps, CFG when
``guidance_scale`` > 1 (3.0; the audio stream guided by the same scale, as
diffusers' ``audio_guidance_scale=None`` does), Gemma prompts padded to 1024
tokens (or the tokenizer's ``model_max_length`` where it is shorter: the
tiny folder's 128). A clip has ``temporal_compression_ratio`` x k + 1 frames;
a side is a multiple of 32 px (LTX2Pipeline's ``check_inputs``).

Not run (diffusers' other guidance terms, off in diffrt): spatio-temporal
guidance (``stg_scale``), modality-isolation guidance (``modality_scale``),
guidance rescale, a separate ``audio_guidance_scale``; diffrt's request has
no field for them, so nothing a request asks is dropped. The features not
yet made to work on LTX-2 are refused, each naming its field (the spec
declares none of them): step caches (``cache``), LoRA (``loras``),
``quantization``, ``offload``, every
multi-rank split (``world_size``), ``output_type="latent"`` (the audio
latents have no field yet).
"""

from __future__ import annotations

from diffrt.engine.model_spec import REQUEST_BATCH_FIELDS, CfgRule, ModelSpec, SamplingDefaults
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.pipelines.flow_match_spec import (
    attention_width,
    check_text_encoder,
    tokenizer_max_length,
)

#: LTX-2's frame rate (LTX2Pipeline's ``frame_rate``)
LTX2_FPS = 24.0
#: the prompt length LTX2Pipeline pads to (``max_sequence_length``)
TEXT_TOKENS = 1024
#: the most frames a request may ask (LTX-2 was trained up to 257)
MAX_FRAMES = 257
#: a side's multiple (LTX2Pipeline refuses others)
SIZE_MULTIPLE = 32


def text_tokens(folder: ModelFolder) -> int:
    """What prompts are padded to: 1024, or the tokenizer's shorter window."""
    return tokenizer_max_length(folder, "tokenizer", TEXT_TOKENS)


def temporal_ratio(folder: ModelFolder) -> int:
    """Frames per latent frame of the video VAE (diffusers' rule: its
    ``patch_size_t`` x 2 per scaling stage, unless the config names one)."""
    vae = folder.vae_config
    ratio = vae.get("temporal_compression_ratio")
    if isinstance(ratio, int):
        return ratio
    stages = vae.get("spatio_temporal_scaling", (True, True, True, True))
    assert isinstance(stages, list | tuple)
    return int(vae.get("patch_size_t", 1)) * 2 ** sum(bool(s) for s in stages)


def describe(folder: ModelFolder) -> ModelSpec:
    """LTX2Pipeline's (or, for an image-to-video folder, LTX2ImageToVideoPipeline's)
    semantics; see the module."""
    check_text_encoder(folder)
    i2v = folder.index.get("_class_name") == "LTX2ImageToVideoPipeline"
    return ModelSpec(
        name=folder.name, family="ltx2",
        pipeline="diffrt.engine.pipelines.ltx2.pipeline:LTX2Pipeline",
        diffusers_pipeline="LTX2ImageToVideoPipeline" if i2v else "LTX2Pipeline",
        folder=folder.path,
        # image-to-video: the first frame in the clip's place, at the clip's size
        tasks=("editing",) if i2v else ("text-to-image",), max_input_images=1 if i2v else 0,
        edit_resize="output", size_multiple=SIZE_MULTIPLE, max_size=2048,
        frame_factor=temporal_ratio(folder), max_frames=MAX_FRAMES,
        defaults=SamplingDefaults(height=512, width=768, num_inference_steps=30,
                                  guidance_scale=3.0, num_frames=121, fps=LTX2_FPS),
        cfg_rule=CfgRule.GUIDANCE_GT_1,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        # a clip's fps sets its audio's length and its positions: one batched
        # forward takes every row's from the first request, so fps is in the key
        request_batch_fields=(*REQUEST_BATCH_FIELDS, "fps"),
        transformer_width=attention_width(folder), text_tokens=text_tokens(folder), sound=True)


__all__ = ["LTX2_FPS", "MAX_FRAMES", "SIZE_MULTIPLE", "TEXT_TOKENS", "describe", "text_tokens"]
