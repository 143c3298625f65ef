"""The Wan family's spec, from a folder's configs (no weights, no diffusers).

What diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` do by
default: 480 x 832 px, 81 frames (16 fps, Wan's own), 50 steps, CFG when
``guidance_scale`` > 1 (5.0) with an empty negative prompt, UMT5 prompts
padded to 512 tokens (or the tokenizer's shorter ``model_max_length``). A
clip has ``scale_factor_temporal`` x k + 1 frames; a side is a multiple of
the VAE's factor x the patch (16 px). Every weight method converts both of
Wan 2.2's experts (``fp8`` where the device multiplies float8, as for
images). CFG parallel, Ulysses and ring split a clip as an image's
(``wan/parallel.py`` for the video tokens).
"""

from __future__ import annotations

from diffrt.engine.cache.policies import POLICIES
from diffrt.engine.model_spec import (
    WEIGHT_METHODS,
    CacheSupport,
    CfgRule,
    ModelSpec,
    SamplingDefaults,
)
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.models.folder_check import ModelLoadError
from diffrt.engine.pipelines.flow_match_spec import (
    attention_width,
    check_text_encoder,
    sequence_parallel_support,
    tokenizer_max_length,
)
from diffrt.engine.pipelines.wan.latents import TEXT_TOKENS

#: Wan's frame rate (its released clips play at 16 fps)
WAN_FPS = 16.0
#: the most frames a request may ask (the rotary table's frame positions
#: bound it lower for a model with a shorter one)
MAX_FRAMES = 257


#: linear layers of WanTransformer3DModel that LoRA adapters for it target:
#: each block's self- and cross-attention (the image-to-video layout's image
#: keys and values too) and feed-forward, as diffusers' Wan LoRA conversions
#: name them
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj",
                       "ffn.net.0.proj", "ffn.net.2")

#: TeaCache's rescaling polynomials for Wan 2.1 text-to-video, highest power
#: first, as the TeaCache authors publish them (github.com/ali-vilab/TeaCache,
#: TeaCache4Wan2.1/teacache_generate.py at 7c10efc, the default mode: fitted
#: on the time embedding ``e``, ``blocks.py``'s signal), keyed by the
#: transformer's (layers, attention heads): T2V-1.3B and T2V-14B
WAN21_T2V_TEACACHE: dict[tuple[int, int], tuple[float, ...]] = {
    (30, 12): (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00,
               1.37887774e-01),
    (40, 40): (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429,
               -13.02252404),
}


def teacache_rescale(folder: ModelFolder, i2v: bool) -> tuple[float, ...]:
    """The published polynomial of a Wan 2.1 text-to-video folder (one
    transformer, its layers and heads those of 1.3B or 14B); none for others
    (Wan 2.2's experts and image-to-video: the distance uncalibrated)."""
    second = folder.index.get("transformer_2") or (None,)
    if i2v or second[0] is not None:
        return ()
    config = folder.transformer_config
    key = (int(config.get("num_layers", 0)), int(config.get("num_attention_heads", 0)))
    return WAN21_T2V_TEACACHE.get(key, ())


def video_geometry(folder: ModelFolder) -> tuple[int, int, int]:
    """A Wan-VAE video folder's (spatial, temporal) VAE factors and its
    side's multiple (the spatial factor x the patch), its text encoder checked."""
    check_text_encoder(folder)
    patch = folder.transformer_config.get("patch_size", (1, 2, 2))
    assert isinstance(patch, list | tuple)
    spatial = int(folder.vae_config.get("scale_factor_spatial", 8))
    return spatial, int(folder.vae_config.get("scale_factor_temporal", 4)), spatial * int(patch[1])


def describe(folder: ModelFolder) -> ModelSpec:
    """WanPipeline's (or, for an image-to-video folder, WanImageToVideoPipeline's)
    semantics; see the module."""
    if folder.index.get("expand_timesteps"):
        # Wan 2.2 TI2V-5B: one folder for both tasks, the first frame's
        # tokens held at timestep 0 by a per-token timestep; not run here
        raise ModelLoadError(f"{folder.path}: {folder.name} sets expand_timesteps (Wan 2.2 "
                             "TI2V-5B's per-token timesteps), which the wan family does not run")
    config = folder.transformer_config
    _, temporal, multiple = video_geometry(folder)
    rope = int(config.get("rope_max_seq_len", 1024))  # positions per axis
    i2v = folder.index.get("_class_name") == "WanImageToVideoPipeline"
    max_frames = min(MAX_FRAMES, (rope - 1) * temporal + 1)  # a valid count: 1 + k·temporal
    return ModelSpec(
        name=folder.name, family="wan", pipeline="diffrt.engine.pipelines.wan.pipeline:WanPipeline",
        diffusers_pipeline="WanImageToVideoPipeline" if i2v else "WanPipeline",
        folder=folder.path,
        # image-to-video: the first frame in the clip's place, at the clip's size
        tasks=("editing",) if i2v else ("text-to-image",), max_input_images=1 if i2v else 0,
        edit_resize="output",
        size_multiple=multiple, max_size=min(2048, rope * multiple),
        frame_factor=temporal, max_frames=max_frames,
        # WanPipeline's 81, or the most a short rotary table allows (a
        # default the folder refuses would fail the engine's warm-up)
        defaults=SamplingDefaults(height=480, width=832, num_inference_steps=50,
                                  guidance_scale=5.0, num_frames=min(81, max_frames),
                                  fps=WAN_FPS),
        cfg_rule=CfgRule.GUIDANCE_GT_1,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        parallel=sequence_parallel_support(folder, "AutoencoderKLWan"),
        lora_target_modules=LORA_TARGET_MODULES,
        quantization=WEIGHT_METHODS,  # both experts (the pipeline's quantize_weights)
        cache=CacheSupport(policies=POLICIES, teacache_rescale=teacache_rescale(folder, i2v)),
        transformer_width=attention_width(folder),
        text_tokens=tokenizer_max_length(folder, "tokenizer", TEXT_TOKENS))


__all__ = ["LORA_TARGET_MODULES", "MAX_FRAMES", "WAN_FPS", "describe", "video_geometry"]
