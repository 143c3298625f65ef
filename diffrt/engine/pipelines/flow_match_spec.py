"""The parts of a spec that the flow-matching families (Flux, SD3,
Qwen-Image) derive alike from a folder's configs: the VAE's factor, the size
limits and the default size."""

from __future__ import annotations

import os
from typing import Any

from diffrt.engine.model_spec import ParallelSupport
from diffrt.engine.models.family import ModelFolder
from diffrt.engine.models.folder_check import ModelLoadError, read_json_object

#: the largest side a family allows with its usual 8x VAE
FAMILY_MAX_SIZE = 2048


def vae_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent of an AutoencoderKL (diffusers' ``vae_scale_factor``)."""
    return 2 ** (len(vae_config.get("block_out_channels", (0, 0, 0, 0))) - 1)


def qwen_vae_factor(vae_config: dict[str, Any]) -> int:
    """AutoencoderKLQwenImage: 8x from its three-entry temporal-downsample list."""
    return 2 ** len(vae_config.get("temperal_downsample", (False, True, True)))


def output_bytes_per_pixel(latent_channels: int, factor: int) -> float:
    """uint8 RGB images take 3 bytes a pixel; float32 latents (``output_type
    "latent"``) ``channels x 4`` per ``factor x factor`` pixels: more than an
    image for a VAE that downsamples little (diffrt-shapes' 2x)."""
    return max(3.0, latent_channels * 4 / (factor * factor))


def scaled_max_size(factor: int) -> int:
    """The family's largest side is meant for an 8x VAE: it bounds the
    transformer's tokens, so a folder whose VAE downsamples less (the 2x VAE
    of diffrt-shapes) gets a proportionally smaller largest picture (a
    2048-pixel request would be 16 times the tokens: minutes per step)."""
    return FAMILY_MAX_SIZE * min(factor, 8) // 8




def attention_width(folder: ModelFolder) -> int:
    """The transformer's attention width, heads x head dim (0 if its config lacks one)."""
    config = folder.transformer_config
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    return heads * dim if isinstance(heads, int) and isinstance(dim, int) else 0


def tokenizer_max_length(folder: ModelFolder, component: str, default: int) -> int:
    """A tokenizer's ``model_max_length`` (``default`` when it names none)."""
    path = os.path.join(folder.path, component, "tokenizer_config.json")
    if not os.path.isfile(path):
        return default
    value = read_json_object(path).get("model_max_length", default)
    return value if isinstance(value, int) and 0 < value < default else default


def check_text_encoder(folder: ModelFolder) -> None:
    """A text-to-image folder conditions on its own text encoders: one it does
    not list is refused before any worker loads it."""
    encoder = folder.index.get("text_encoder")
    if not (isinstance(encoder, list) and len(encoder) == 2 and encoder[0] is not None):
        raise ModelLoadError(f"{os.path.join(folder.path, 'model_index.json')}: lists no "
                             "text_encoder (diffrt conditions images on the prompt with the "
                             "folder's own text encoders)")


def sequence_parallel_support(folder: ModelFolder, vae_class: str) -> ParallelSupport:
    """Every split (CFG, Ulysses, ring): Ulysses needs the folder's head count,
    the banded decode its VAE's class (``vae_class`` when the config names none)."""
    return ParallelSupport(multi_rank=True, sequence=True,
                           attention_heads=folder.transformer_config.get("num_attention_heads"),
                           vae_class=folder.vae_config.get("_class_name", vae_class))


__all__ = ["FAMILY_MAX_SIZE", "check_text_encoder", "output_bytes_per_pixel", "qwen_vae_factor",
           "scaled_max_size",
           "sequence_parallel_support", "vae_factor"]
