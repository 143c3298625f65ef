"""The Qwen-Image family's spec, from a folder's configs (no weights, no diffusers)."""

from __future__ import annotations

from diffrt.engine.cache.policies import POLICIES
from diffrt.engine.model_spec import (
    TEXT_TO_IMAGE_TASKS,
    WEIGHT_METHODS,
    CacheSupport,
    CfgRule,
    ModelSpec,
    ParallelSupport,
    SamplingDefaults,
)
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.models.folder_check import ModelLoadError
from diffrt.engine.pipelines.flow_match_spec import (
    attention_width,
    check_text_encoder,
    output_bytes_per_pixel,
    qwen_vae_factor,
    scaled_max_size,
    sequence_parallel_support,
)

#: linear layers of QwenImageTransformer2DModel that LoRA adapters for it
#: target (joint attention, the image and text feed-forwards)
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                       "add_v_proj", "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                       "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1", "txt_mod.1")

#: QwenImageTransformer2DModel options of the edit and layered variants, which
#: ``mixed.forward_rows`` does not implement
EDIT_OPTIONS = ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


#: diffusers' Qwen-Image-Edit pipeline classes served: one input image, or
#: several (Plus: each also read by Qwen2.5-VL at 384 x 384 px)
EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
#: the images a Plus request may give (the model card's one to three)
PLUS_MAX_IMAGES = 3


def describe(folder: ModelFolder) -> ModelSpec:
    """QwenImagePipeline's semantics: Flux's packed layout, 1024 px and 50
    steps by default, true CFG at 4.0 with a negative prompt (its
    ``guidance_scale`` is unused by the released checkpoints), the
    Qwen-Image VAE (no banded parallel decode)."""
    check_text_encoder(folder)
    factor = qwen_vae_factor(folder.vae_config)
    size = 128 * factor
    # Qwen-Image-Edit: Qwen2.5-VL reads the input image with the prompt, and
    # the image's latents join the sequence; one rank (the sequence split
    # knows no conditioning tokens)
    pipeline_class = folder.index.get("_class_name")
    edit = pipeline_class in EDIT_PIPELINES
    plus = pipeline_class == "QwenImageEditPlusPipeline"
    options = [o for o in EDIT_OPTIONS if folder.transformer_config.get(o)]
    if edit and options:  # 2511-style: conditioning tokens modulated apart, per call
        raise ModelLoadError(f"{folder.path}: a Qwen-Image-Edit transformer with "
                             f"{', '.join(options)} is not served yet (its conditioning tokens "
                             "are modulated apart, which rows of other lengths would mix)")
    return ModelSpec(
        name=folder.name, family="qwen-image",
        pipeline="diffrt.engine.pipelines.qwen_image.pipeline:QwenImagePipeline",
        diffusers_pipeline=pipeline_class if edit else "QwenImagePipeline", folder=folder.path,
        tasks=("editing",) if edit else TEXT_TO_IMAGE_TASKS, rollouts=True,
        max_input_images=PLUS_MAX_IMAGES if plus else 1, edit_resize="area",
        # Plus: the VAE at 1024 x 1024 px (VAE_IMAGE_SIZE), Qwen2.5-VL at 384 x
        # 384 (CONDITION_IMAGE_SIZE), the default size from the last image
        edit_prompt_area=384 * 384 if plus else None, edit_size_from="last" if plus else "first",
        size_multiple=factor * 2, max_size=scaled_max_size(factor),
        defaults=SamplingDefaults(height=size, width=size, num_inference_steps=50,
                                  guidance_scale=1.0, true_cfg_scale=4.0),
        cfg_rule=CfgRule.TRUE_CFG_AND_NEGATIVE,
        supports_request_batch=True, supports_step_execution=True,
        # rows of different sizes share a call (mixed.py), for the text-to-image
        # transformer: the edit variants' inputs are not in that forward
        mixed_sizes=not any(folder.transformer_config.get(option) for option in EDIT_OPTIONS),
        parallel=ParallelSupport() if edit else sequence_parallel_support(
            folder, "AutoencoderKLQwenImage"),
        lora_target_modules=LORA_TARGET_MODULES, quantization=WEIGHT_METHODS,
        # the step caches cut diffusers' forward, which the edit variants' options change
        cache=CacheSupport(policies=() if options else POLICIES),
        # its text follows each prompt (padded to the batch's longest): the
        # run-time estimate counts image tokens only
        transformer_width=attention_width(folder), text_tokens=0,
        output_bytes_per_pixel=output_bytes_per_pixel(int(folder.vae_config.get("z_dim", 16)), factor))
