"""Complete tiny Wan folders (2.1 / 2.2, text- and image-to-video), built
locally and deterministically.

``build_tiny_wan_folder`` writes a folder diffusers' own ``WanPipeline``
(``i2v=True``: ``WanImageToVideoPipeline``) loads offline: a
``WanTransformer3DModel`` (two of them with ``two_experts=True``, Wan 2.2's
high-noise ``transformer`` and low-noise ``transformer_2`` switched at the
folder's ``boundary_ratio``), an ``AutoencoderKLWan``, the flow-matching
scheduler, and a tiny UMT5 encoder with a T5 tokenizer from the shared pieces
of ``tiny/shared.py``.

Shapes (read from diffusers' pipelines): the VAE compresses 4x in time and 8x
in space, so a clip has 4k + 1 frames and its latents (k + 1) frames; the
transformer patches (1, 2, 2), so a side is a multiple of 16 px. Image-to-
video (Wan 2.2 A14B's layout, no CLIP image encoder) gives the transformer
the noise's 16 channels, a 4-channel first-frame mask and the first frame's
16 latent channels: 36 in, 16 out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from diffrt.engine.models.tiny import shared

#: UMT5 as Wan's text encoder (umt5-xxl in the released models).
TINY_UMT5: shared.ComponentConfig = {**shared.TINY_T5, "d_model": 32}

#: ``AutoencoderKLWan`` at its smallest (diffusers' own tests build this one):
#: 4x temporal, 8x spatial compression, 16 latent channels.
TINY_WAN_VAE: shared.ComponentConfig = dict(
    base_dim=3,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)

TINY_WAN_TRANSFORMER: shared.ComponentConfig = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=TINY_UMT5["d_model"],
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

#: the image-to-video transformer's input: noise, first-frame mask, first frame
I2V_IN_CHANNELS = 16 + 4 + 16

#: Wan's scheduler (the released 2.1 / 2.2 folders' flow shift for 480p)
WAN_SCHEDULER: shared.ComponentConfig = dict(num_train_timesteps=1000, shift=3.0)

#: Wan 2.2 A14B's expert switch (``boundary_ratio`` x 1000 train timesteps):
#: text-to-video 0.875, image-to-video 0.9, as its released folders say
BOUNDARY_RATIO = {"t2v": 0.875, "i2v": 0.9}

#: the tokenizer's ``model_max_length``: what Wan's pipelines pad prompts to
#: (``max_sequence_length``'s default; diffrt reads a shorter one from here)
WAN_MAX_LENGTH = 512

#: Factors applied to the fresh transformer's weights so the prompt shows in
#: the frames (see ``tiny/shared.py``): the cross-attention's keys and values
#: read the text, the text projection feeds them. How much shows depends on
#: the seed (the tiny VAE's decoder flattens some): mean |difference| between
#: two prompts' 9 x 64^2 clips (4 steps, two experts), seed 1: 6.2 and 7.4 /
#: 255; seed 7: 1.7 and 0.9 / 255.
PROMPT_BOOST: dict[str, float] = {
    "condition_embedder.text_embedder.linear_1.weight": 4.0,
    "condition_embedder.text_embedder.linear_2.weight": 4.0,
    "attn2.to_k.weight": 8.0,
    "attn2.to_v.weight": 16.0,
}

_SEED_OFFSETS = {**shared._SEED_OFFSETS, "transformer_2": 5}


def umt5(seed: int, vocab_size: int) -> torch.nn.Module:
    """The tiny UMT5 encoder of the Wan and Helios folders, built under ``seed``."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0, is_encoder_decoder=False, **TINY_UMT5)
    with shared.seeded_init(seed):
        return UMT5EncoderModel(config).eval()


def wan_components(i2v: bool, two_experts: bool) -> dict[str, tuple[str | None, str | None]]:
    """A Wan folder's components (model_index.json); an image-to-video folder
    of Wan 2.2's layout leaves the CLIP image encoder out."""
    components: dict[str, tuple[str | None, str | None]] = {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "UMT5EncoderModel"),
        "tokenizer": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "WanTransformer3DModel"),
        "transformer_2": ("diffusers", "WanTransformer3DModel") if two_experts else (None, None),
        "vae": ("diffusers", "AutoencoderKLWan"),
    }
    if i2v:
        components.update(image_encoder=(None, None), image_processor=(None, None))
    return components


def build_tiny_wan_folder(path: str | os.PathLike, *, seed: int = 0, i2v: bool = False,
                          two_experts: bool = False) -> Path:
    """A complete tiny Wan folder at ``path``: text-to-video (``WanPipeline``)
    or, with ``i2v``, image-to-video (``WanImageToVideoPipeline``); with
    ``two_experts`` Wan 2.2's pair of transformers and its boundary ratio."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = shared.build_t5_tokenizer(path / "tokenizer", max_length=WAN_MAX_LENGTH)
    transformer = {**TINY_WAN_TRANSFORMER, **({"in_channels": I2V_IN_CHANNELS} if i2v else {})}
    for name in ("transformer", "transformer_2") if two_experts else ("transformer",):
        shared.save_seeded(path / name, WanTransformer3DModel, seed + _SEED_OFFSETS[name],
                           boost=PROMPT_BOOST, **transformer)
    shared.save_seeded(path / "vae", AutoencoderKLWan, seed + _SEED_OFFSETS["vae"],
                       **TINY_WAN_VAE)
    FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER).save_pretrained(path / "scheduler")
    shared._save(umt5(seed + _SEED_OFFSETS["text_encoder"], len(tokenizer)), path / "text_encoder")
    write_wan_index(path, i2v=i2v, two_experts=two_experts)
    return path


def write_wan_index(path: Path, *, i2v: bool = False, two_experts: bool = False) -> None:
    """A Wan folder's ``model_index.json``: its components and the pipeline's
    own config (``boundary_ratio``, ``expand_timesteps``), as diffusers saves
    it (also written by ``scripts/train_motion_model.py``)."""
    pipeline = "WanImageToVideoPipeline" if i2v else "WanPipeline"
    shared._write_index(path, pipeline, wan_components(i2v, two_experts))
    index_path = path / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    # the pipeline's own config (register_to_config), beside its components
    index["boundary_ratio"] = BOUNDARY_RATIO["i2v" if i2v else "t2v"] if two_experts else None
    index["expand_timesteps"] = False
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


__all__ = ["BOUNDARY_RATIO", "I2V_IN_CHANNELS", "PROMPT_BOOST", "TINY_UMT5", "TINY_WAN_TRANSFORMER",
           "TINY_WAN_VAE", "WAN_MAX_LENGTH", "WAN_SCHEDULER", "build_tiny_wan_folder",
           "umt5", "wan_components", "write_wan_index"]
