"""The SD3 family's spec, from a folder's configs (no weights, no diffusers)."""

from __future__ import annotations

from diffrt.engine.cache.policies import POLICIES
from diffrt.engine.model_spec import (
    TEXT_TO_IMAGE_TASKS,
    WEIGHT_METHODS,
    CacheSupport,
    CfgRule,
    ModelSpec,
    SamplingDefaults,
)
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.pipelines.flow_match_spec import (
    attention_width,
    check_text_encoder,
    output_bytes_per_pixel,
    scaled_max_size,
    sequence_parallel_support,
    vae_factor,
)

#: linear layers of SD3Transformer2DModel that LoRA adapters for it target
#: (joint attention and feed-forwards), as diffusers' SD3 LoRA training names them
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                       "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                       "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                       "norm1_context.linear")


#: the joint sequence's text part: the CLIPs' 77 tokens and T5's 256
#: (``SD3Pipeline.encode_with_diffusers``), concatenated
TEXT_TOKENS = 77 + 256


def describe(folder: ModelFolder) -> ModelSpec:
    """StableDiffusion3Pipeline's semantics: the transformer patchifies (size
    multiple VAE factor x patch), its positional-embedding grid bounds the
    size, the default size is its ``sample_size``, 28 steps, CFG when
    ``guidance_scale`` > 1 (7.0 by default); rows of different sizes share
    a step (``sd3/mixed.py``, SD3.5's dual attention included)."""
    check_text_encoder(folder)
    config = folder.transformer_config
    factor = vae_factor(folder.vae_config)
    patch = int(config.get("patch_size", 2))
    grid = config.get("pos_embed_max_size")
    size = int(config.get("sample_size", 128)) * factor
    return ModelSpec(
        name=folder.name, family="sd3", pipeline="diffrt.engine.pipelines.sd3.pipeline:SD3Pipeline",
        diffusers_pipeline="StableDiffusion3Pipeline", folder=folder.path,
        tasks=TEXT_TO_IMAGE_TASKS, max_input_images=1, rollouts=True,
        size_multiple=factor * patch,
        max_size=int(grid) * patch * factor if grid else scaled_max_size(factor),
        defaults=SamplingDefaults(height=size, width=size, num_inference_steps=28,
                                  guidance_scale=7.0),
        cfg_rule=CfgRule.GUIDANCE_GT_1,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        parallel=sequence_parallel_support(folder, "AutoencoderKL"),
        lora_target_modules=LORA_TARGET_MODULES, quantization=WEIGHT_METHODS,
        cache=CacheSupport(policies=POLICIES),
        transformer_width=attention_width(folder), text_tokens=TEXT_TOKENS,
        output_bytes_per_pixel=output_bytes_per_pixel(int(folder.vae_config.get("latent_channels", 16)), factor))
