"""A complete tiny SD3 / SD3.5 folder, built locally and deterministically.

``build_tiny_sd3_folder`` writes a folder diffusers' own
``StableDiffusion3Pipeline`` loads offline: transformer, VAE, scheduler and
the folder's own two tiny CLIP encoders and T5 with their tokenizers, all
from the shared pieces of ``tiny/shared.py``.

Shapes (read from diffusers' pipeline): the two CLIPs' penultimate hidden
states are concatenated and zero-padded to T5's width, so T5 ``d_model`` (=
``joint_attention_dim``) must be at least the sum of the CLIP hidden sizes
(diffusers crops silently otherwise: ``F.pad`` with a negative width);
``pooled_projection_dim`` = the sum of the CLIP projection dims.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffrt.engine.models.tiny import shared

#: SD3's T5 is wider than the two CLIPs together (32 + 32 < 96), as in the
#: real model (768 + 1280 < 4096): the concatenated CLIP states are zero-padded.
TINY_SD3_T5: shared.ComponentConfig = {**shared.TINY_T5, "d_model": 96}

TINY_SD3_VAE: shared.ComponentConfig = {**shared.TINY_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}

TINY_SD3_TRANSFORMER: shared.ComponentConfig = dict(
    sample_size=16,
    patch_size=2,
    in_channels=shared.TINY_VAE["latent_channels"],
    out_channels=shared.TINY_VAE["latent_channels"],
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TINY_SD3_T5["d_model"],
    caption_projection_dim=32,  # = num_attention_heads * attention_head_dim
    pooled_projection_dim=2 * shared.TINY_CLIP_TEXT["projection_dim"],
    pos_embed_max_size=32,
)

#: SD3.5 (Medium-style): RMS-normed q/k and a dual-attention first block.
TINY_SD35_EXTRA: shared.ComponentConfig = dict(qk_norm="rms_norm", dual_attention_layers=(0,))

#: SD3 / SD3.5's scheduler (fixed shift).
SD3_SCHEDULER: shared.ComponentConfig = dict(num_train_timesteps=1000, shift=3.0)

#: Factors applied to the fresh transformer's weights so the prompt shows in
#: the image (see ``tiny/shared.py``), by parameter-name suffix. SD3 has no q/k
#: norm, so its attention logits scale with the projections; SD3.5's RMS
#: q/k norm scales them with its weight. Mean |difference| between two
#: prompts' 64x64 images (4 steps, fp32, CPU), min over 10 prompt pairs:
#: SD3 2.1 -> 28/255, SD3.5 1.6 -> 22/255.
PROMPT_BOOST: dict[str, dict[str, float]] = {
    "sd3": {
        shared.POOLED_PROJECTION + "1.weight": 2.0,
        shared.POOLED_PROJECTION + "2.weight": 2.0,
        "attn.to_q.weight": 2.0,
        "attn.add_k_proj.weight": 16.0,
        "attn.add_v_proj.weight": 16.0,
    },
    "sd35": {
        shared.POOLED_PROJECTION + "1.weight": 2.0,
        shared.POOLED_PROJECTION + "2.weight": 2.0,
        "attn.norm_q.weight": 2.0,
        "attn.norm_added_k.weight": 8.0,
        "attn.add_v_proj.weight": 16.0,
    },
}

#: a StableDiffusion3Pipeline folder's components (model_index.json)
SD3_COMPONENTS: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
    "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
    "text_encoder_3": ("transformers", "T5EncoderModel"),
    "tokenizer": ("transformers", "CLIPTokenizer"),
    "tokenizer_2": ("transformers", "CLIPTokenizer"),
    "tokenizer_3": ("transformers", "T5TokenizerFast"),
    "transformer": ("diffusers", "SD3Transformer2DModel"),
    "vae": ("diffusers", "AutoencoderKL"),
}


def build_tiny_sd3_folder(path: str | os.PathLike, *, seed: int = 0, sd35: bool = False,
                          dynamic_shifting: bool = False, latent_channels: int | None = None
                          ) -> Path:
    """A complete tiny SD3 folder at ``path`` (StableDiffusion3Pipeline loads
    it offline). ``sd35=True``: SD3.5-style transformer (RMS q/k norm, a dual
    attention block). ``dynamic_shifting=True``: the scheduler shifts by
    resolution as Flux's does (the pipeline then computes ``mu``).
    ``latent_channels``: other than the tiny VAE's (diffusers'
    StableDiffusion3InpaintPipeline runs only a 16-channel transformer).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    clip_tok = shared.build_clip_tokenizer(path / "tokenizer")
    shared.build_clip_tokenizer(path / "tokenizer_2")
    t5_tok = shared.build_t5_tokenizer(path / "tokenizer_3")
    offsets = shared._SEED_OFFSETS
    channels = ({} if latent_channels is None else
                {"in_channels": latent_channels, "out_channels": latent_channels})
    shared.save_seeded(path / "transformer", SD3Transformer2DModel, seed + offsets["transformer"],
                       boost=PROMPT_BOOST["sd35" if sd35 else "sd3"],
                       **{**TINY_SD3_TRANSFORMER, **channels}, **(TINY_SD35_EXTRA if sd35 else {}))
    vae = TINY_SD3_VAE if latent_channels is None else {**TINY_SD3_VAE,
                                                        "latent_channels": latent_channels}
    shared.save_seeded(path / "vae", AutoencoderKL, seed + offsets["vae"], **vae)
    scheduler = {**SD3_SCHEDULER, **(shared.DYNAMIC_SHIFT if dynamic_shifting else {})}
    noise_scheduler = FlowMatchEulerDiscreteScheduler(**scheduler)
    noise_scheduler.save_pretrained(path / "scheduler")
    vocab = clip_tok.get_vocab()
    for name in ("text_encoder", "text_encoder_2"):
        shared._save(shared._clip_text(CLIPTextModelWithProjection, seed + offsets[name], vocab),
                     path / name)
    shared._save(shared._t5(seed + offsets["text_encoder_3"], len(t5_tok), TINY_SD3_T5),
                 path / "text_encoder_3")
    shared._write_index(path, "StableDiffusion3Pipeline", SD3_COMPONENTS)
    return path


__all__ = ["PROMPT_BOOST", "SD3_COMPONENTS", "SD3_SCHEDULER", "TINY_SD35_EXTRA",
           "TINY_SD3_T5", "TINY_SD3_TRANSFORMER", "TINY_SD3_VAE", "build_tiny_sd3_folder"]
