"""The Flux family's spec, from a folder's configs (no weights, no diffusers)."""

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
    Task,
)
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.pipelines.flow_match_spec import (
    attention_width,
    check_text_encoder,
    output_bytes_per_pixel,
    scaled_max_size,
    sequence_parallel_support,
    tokenizer_max_length,
    vae_factor,
)

#: linear layers of FluxTransformer2DModel that LoRA adapters for it target:
#: the double blocks' joint attention and feed-forwards and the single
#: blocks' projections, as diffusers' Flux LoRA training script names them;
#: the blocks' modulation (kohya's ``img_mod_lin``, ``txt_mod_lin``,
#: ``modulation_lin``, which diffusers converts to ``norm1.linear``,
#: ``norm1_context.linear``, ``norm.linear``), the output norm's, and the
#: input embedders some community files train
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                       "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                       "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
                       "norm1.linear", "norm1_context.linear", "norm.linear",
                       "norm_out.linear", "x_embedder", "context_embedder")


#: the (width, height) resolutions FLUX.1 Kontext was trained on, as
#: diffusers' ``PREFERRED_KONTEXT_RESOLUTIONS`` lists them (a test compares)
KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328),
                       (832, 1248), (880, 1184), (944, 1104), (1024, 1024), (1104, 944),
                       (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720),
                       (1504, 688), (1568, 672))


#: TeaCache's rescaling polynomial for FLUX.1 [dev] (highest power first), as
#: the TeaCache authors fitted it (``TeaCache4FLUX``'s ``coefficients``)
FLUX_DEV_TEACACHE = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00,
                     2.64230861e-01)
#: FLUX.1 [dev]'s transformer, by the config fields that tell it from other Flux checkpoints
FLUX_DEV_TRANSFORMER = {"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                        "num_attention_heads": 24, "guidance_embeds": True}


def teacache_rescale(folder: ModelFolder) -> tuple[float, ...]:
    """The TeaCache polynomial fitted for this checkpoint: FLUX.1 [dev]'s for its
    transformer (Kontext is not it), none for others (the distance uncalibrated;
    an embedded or shipped model's own comes from its registry entry)."""
    config = folder.transformer_config
    if folder.index.get("_class_name") == "FluxPipeline" and all(
            config.get(k) == v for k, v in FLUX_DEV_TRANSFORMER.items()):
        return FLUX_DEV_TEACACHE
    return ()


def describe(folder: ModelFolder) -> ModelSpec:
    """FluxPipeline's semantics: 2x2-packed latents (size multiple twice the
    VAE factor), its default size of 128 latents per side, 28 steps, embedded
    guidance 3.5, and true CFG only with ``true_cfg_scale`` > 1 and a negative
    prompt."""
    check_text_encoder(folder)
    factor = vae_factor(folder.vae_config)
    size = 128 * factor
    # FLUX.1 Kontext: the same transformer, given the input image's latents as
    # extra tokens (an edit); without an image it draws from text. One rank:
    # the sequence split knows no conditioning tokens
    kontext = folder.index.get("_class_name") == "FluxKontextPipeline"
    tasks: tuple[Task, ...] = ("text-to-image", "editing") if kontext else TEXT_TO_IMAGE_TASKS
    return ModelSpec(
        name=folder.name, family="flux", pipeline="diffrt.engine.pipelines.flux.pipeline:FluxPipeline",
        diffusers_pipeline="FluxKontextPipeline" if kontext else "FluxPipeline",
        folder=folder.path, max_input_images=1, tasks=tasks, rollouts=True,
        edit_resolutions=KONTEXT_RESOLUTIONS if kontext else (),
        parallel=ParallelSupport() if kontext else sequence_parallel_support(folder,
                                                                             "AutoencoderKL"),
        size_multiple=factor * 2, max_size=scaled_max_size(factor),
        defaults=SamplingDefaults(height=size, width=size, num_inference_steps=28,
                                  guidance_scale=3.5),
        cfg_rule=CfgRule.TRUE_CFG_AND_NEGATIVE,
        supports_request_batch=True, supports_step_execution=True, mixed_sizes=True,
        lora_target_modules=LORA_TARGET_MODULES, quantization=WEIGHT_METHODS,
        cache=CacheSupport(policies=POLICIES, teacache_rescale=teacache_rescale(folder)),
        transformer_width=attention_width(folder),
        text_tokens=tokenizer_max_length(folder, "tokenizer_2", 512),  # as its encoding
        output_bytes_per_pixel=output_bytes_per_pixel(int(folder.vae_config.get("latent_channels", 16)), factor))
