"""Tiny LoRA adapter files for the tests, made offline: PEFT adapters on a
tiny folder's transformer with both factors drawn from a seeded generator
(PEFT's default leaves B at zero, which changes nothing), saved by the
family's diffusers pipeline class (``save_lora_weights``) as diffusers would
save a trained one; and kohya- and XLabs-format Flux files diffusers converts."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def make_adapter(folder: str, pipeline_class: str, out: str | os.PathLike, *,
                 targets: tuple[str, ...], rank: int = 4, alpha: float | None = None,
                 seed: int = 0, magnitude: float = 0.5) -> str:
    """Write ``out``/pytorch_lora_weights.safetensors; return ``out``."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    cls = getattr(diffusers, pipeline_class)
    index = __import__("json").loads(Path(folder, "model_index.json").read_text())
    transformer_cls = getattr(diffusers, index["transformer"][1])
    transformer = transformer_cls.from_pretrained(os.path.join(folder, "transformer"))
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank,
                        target_modules=list(targets), init_lora_weights=False)
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * magnitude
                            / param.shape[-1] ** 0.5)
    state = get_peft_model_state_dict(transformer)
    os.makedirs(out, exist_ok=True)
    cls.save_lora_weights(str(out), transformer_lora_layers=state,
                          transformer_lora_adapter_metadata=config.to_dict())
    return str(out)


def _flux_dims(folder: str) -> dict:
    import json

    return json.loads(Path(folder, "transformer", "config.json").read_text())


def _write_community_file(out: str | os.PathLike, layers: list[tuple[str, int, int]], *,
                          down: str, up: str, alpha: float | None, rank: int, seed: int,
                          magnitude: float) -> str:
    """A file of seeded (down, up[, alpha]) factors for ``layers`` (prefix,
    out, in), spelt with the ``down``/``up`` suffixes of a community format."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for prefix, out_features, in_features in layers:
        state[f"{prefix}.{down}"] = (torch.randn(rank, in_features, generator=generator)
                                     * magnitude / in_features ** 0.5)
        state[f"{prefix}.{up}"] = (torch.randn(out_features, rank, generator=generator)
                                   * magnitude / rank ** 0.5)
        if alpha is not None:
            state[f"{prefix}.alpha"] = torch.tensor(alpha)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def make_kohya_flux(folder: str, out: str | os.PathLike, *, rank: int = 4, seed: int = 0,
                    magnitude: float = 0.5) -> str:
    """A kohya-style Flux file (``lora_unet_double_blocks_0_img_attn_qkv.lora_down``,
    ``.lora_up``, ``.alpha``; attention, projections and the blocks'
    modulation, as sd-scripts trains them) for the tiny folder's transformer;
    returns its path."""
    config = _flux_dims(folder)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    layers = []
    for i in range(config["num_layers"]):
        layers += [(f"lora_unet_double_blocks_{i}_img_attn_qkv", 3 * dim, dim),
                   (f"lora_unet_double_blocks_{i}_txt_attn_proj", dim, dim),
                   (f"lora_unet_double_blocks_{i}_img_mod_lin", 6 * dim, dim),
                   (f"lora_unet_double_blocks_{i}_txt_mod_lin", 6 * dim, dim)]
    for i in range(config["num_single_layers"]):
        layers += [(f"lora_unet_single_blocks_{i}_linear2", dim,
                    dim + int(dim * config.get("mlp_ratio", 4.0))),
                   (f"lora_unet_single_blocks_{i}_modulation_lin", 3 * dim, dim)]
    return _write_community_file(out, layers, down="lora_down.weight", up="lora_up.weight",
                                 alpha=float(rank) / 2, rank=rank, seed=seed,
                                 magnitude=magnitude)


def make_xlabs_flux(folder: str, out: str | os.PathLike, *, rank: int = 4, seed: int = 0,
                    magnitude: float = 1.5) -> str:
    """An XLabs-style Flux file (``double_blocks.0.processor.qkv_lora1.down.weight``,
    ``.up.weight``; image and text attention, no alphas) for the tiny folder's
    transformer; returns its path."""
    config = _flux_dims(folder)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    layers = []
    for i in range(config["num_layers"]):
        layers += [(f"double_blocks.{i}.processor.qkv_lora1", 3 * dim, dim),
                   (f"double_blocks.{i}.processor.proj_lora1", dim, dim),
                   (f"double_blocks.{i}.processor.qkv_lora2", 3 * dim, dim),
                   (f"double_blocks.{i}.processor.proj_lora2", dim, dim)]
    return _write_community_file(out, layers, down="down.weight", up="up.weight", alpha=None,
                                 rank=rank, seed=seed, magnitude=magnitude)
