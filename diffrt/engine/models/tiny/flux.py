"""Complete tiny FLUX.1 and FLUX.1 Kontext folders, built locally and deterministically.

``build_tiny_flux_folder`` writes a folder diffusers' own ``FluxPipeline``
loads offline: transformer, VAE, scheduler and the folder's own tiny CLIP and
T5 text encoders with their tokenizers, all from the shared pieces of
``tiny/shared.py``. ``build_tiny_flux_kontext_folder`` writes the same
components for ``FluxKontextPipeline`` (and ``FluxKontextInpaintPipeline``).

Shapes (read from diffusers' pipeline): latent channels = VAE
``latent_channels`` = transformer ``in_channels // 4`` (latents are packed
2x2); ``joint_attention_dim`` = T5 ``d_model``; ``pooled_projection_dim`` =
CLIP ``hidden_size`` (the pooled output of ``CLIPTextModel``, not a
projection).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from diffrt.engine.models.tiny import shared

TINY_FLUX_VAE: shared.ComponentConfig = {**shared.TINY_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}

TINY_FLUX_TRANSFORMER: shared.ComponentConfig = dict(
    patch_size=1,
    in_channels=4 * shared.TINY_VAE["latent_channels"],
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=shared.TINY_T5["d_model"],
    pooled_projection_dim=shared.TINY_CLIP_TEXT["hidden_size"],
    axes_dims_rope=(4, 6, 6),
)

#: FLUX.1-dev's scheduler (resolution-dependent shift).
FLUX_SCHEDULER: shared.ComponentConfig = dict(num_train_timesteps=1000, shift=3.0, **shared.DYNAMIC_SHIFT)

#: Factors applied to the fresh transformer's weights so the prompt shows in
#: the image (see ``tiny/shared.py``), by parameter-name suffix: the pooled
#: prompt's projection, sharper attention from image queries to text keys
#: (the few prompt tokens otherwise drown among hundreds of padding tokens;
#: with an RMS q/k norm the logits scale with its weight) and larger text
#: values. Mean |difference| between two prompts' 64x64 images (4 steps,
#: fp32, CPU), min over 10 prompt pairs: 1.1 -> 20/255.
PROMPT_BOOST: dict[str, float] = {
    shared.POOLED_PROJECTION + "1.weight": 4.0,
    shared.POOLED_PROJECTION + "2.weight": 4.0,
    "attn.norm_added_k.weight": 8.0,
    "attn.add_v_proj.weight": 8.0,
}


def build_tiny_flux_folder(path: str | os.PathLike, *, seed: int = 0,
                           guidance_embeds: bool = False) -> Path:
    """A complete tiny FLUX.1 folder at ``path`` (FluxPipeline loads it offline).

    ``guidance_embeds=True`` gives a guidance-distilled ("dev"-style)
    transformer that takes ``guidance_scale`` as an input.
    """
    return _build(Path(path), seed, guidance_embeds, PROMPT_BOOST, "FluxPipeline",
                  shared.FLUX_COMPONENTS)


#: ``PROMPT_BOOST`` and sharper attention to image keys, so the input image
#: shows in the output: the prompt boost makes the text keys win every query,
#: and the input image's tokens (keys of the image stream, as the noise's are)
#: then barely count. Mean |difference| between the 64x64 outputs for four
#: input images (2 steps, fp32, CPU), min over the pairs with one of them:
#: 0.2/255 -> 12/255 (between two prompts: 25 -> 28).
KONTEXT_BOOST: dict[str, float] = {**PROMPT_BOOST, "attn.norm_k.weight": 8.0}

#: FLUX.1 Kontext [dev]'s model_index.json: FluxPipeline's components and
#: the two optional IP-Adapter ones, left out
FLUX_KONTEXT_COMPONENTS: dict[str, tuple[str, str] | tuple[None, None]] = {
    **shared.FLUX_COMPONENTS, "feature_extractor": (None, None), "image_encoder": (None, None)}


def build_tiny_flux_kontext_folder(path: str | os.PathLike, *, seed: int = 0,
                                   guidance_embeds: bool = True) -> Path:
    """A complete tiny FLUX.1 Kontext folder at ``path``: FluxKontextPipeline
    and FluxKontextInpaintPipeline load it offline.

    Kontext is a FLUX.1 transformer that sees the input image's latents as
    extra tokens, so the components and configurations are FluxPipeline's
    (the same seed gives the same weights as ``build_tiny_flux_folder``,
    except the transformer's ``KONTEXT_BOOST``); model_index.json names the
    Kontext pipeline. Guidance-distilled by default, as FLUX.1 Kontext [dev]
    is.
    """
    return _build(Path(path), seed, guidance_embeds, KONTEXT_BOOST, "FluxKontextPipeline",
                  FLUX_KONTEXT_COMPONENTS)


def _build(path: Path, seed: int, guidance_embeds: bool, boost: dict[str, float],
           class_name: str, components: Mapping[str, tuple[str | None, str | None]]) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    path.mkdir(parents=True, exist_ok=True)
    clip_tok = shared.build_clip_tokenizer(path / "tokenizer")
    t5_tok = shared.build_t5_tokenizer(path / "tokenizer_2")
    offsets = shared._SEED_OFFSETS
    shared.save_seeded(path / "transformer", FluxTransformer2DModel, seed + offsets["transformer"],
                       boost=boost, **TINY_FLUX_TRANSFORMER,
                       guidance_embeds=guidance_embeds)
    shared.save_seeded(path / "vae", AutoencoderKL, seed + offsets["vae"], **TINY_FLUX_VAE)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    scheduler.save_pretrained(path / "scheduler")
    shared._save(shared._clip_text(CLIPTextModel, seed + offsets["text_encoder"],
                                   clip_tok.get_vocab()), path / "text_encoder")
    shared._save(shared._t5(seed + offsets["text_encoder_2"], len(t5_tok), shared.TINY_T5),
                 path / "text_encoder_2")
    shared._write_index(path, class_name, components)
    return path


__all__ = ["FLUX_KONTEXT_COMPONENTS", "FLUX_SCHEDULER", "KONTEXT_BOOST", "PROMPT_BOOST",
           "TINY_FLUX_TRANSFORMER", "TINY_FLUX_VAE", "build_tiny_flux_folder",
           "build_tiny_flux_kontext_folder"]
