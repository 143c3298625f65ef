"""A complete tiny Helios folder, built locally and deterministically.

``build_tiny_helios_folder`` writes a folder diffusers' own ``HeliosPipeline``
loads offline: a ``HeliosTransformer3DModel`` (Wan's blocks plus the patch
embeddings of its multi-term memory: the history of earlier chunks at three
scales), Wan's VAE, a one-stage ``HeliosScheduler`` (Helios-Base's: the
pyramid variant runs three stages) and the tiny UMT5 encoder of the Wan
folders. A Helios request is denoised in chunks of
``num_latent_frames_per_chunk`` latent frames, each conditioned on the ones
before it.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffrt.engine.models.tiny import shared, wan

TINY_HELIOS_TRANSFORMER: shared.ComponentConfig = {
    **{k: v for k, v in wan.TINY_WAN_TRANSFORMER.items() if k != "rope_max_seq_len"},
    # one rotary table per axis (frames, height, width), summing to the head dim
    "rope_dim": (4, 4, 4),
}

#: Helios-Base's scheduler: one stage of flow-matching UniPC
HELIOS_SCHEDULER: shared.ComponentConfig = dict(num_train_timesteps=1000, stages=1)

#: the prompt length Helios' pipeline pads to (``max_sequence_length``)
HELIOS_MAX_LENGTH = 512

HELIOS_COMPONENTS: dict[str, tuple[str | None, str | None]] = {
    "scheduler": ("diffusers", "HeliosScheduler"),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "T5TokenizerFast"),
    "transformer": ("diffusers", "HeliosTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}


def build_tiny_helios_folder(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A complete tiny Helios folder at ``path`` (``HeliosPipeline`` loads it offline)."""
    from diffusers import AutoencoderKLWan, HeliosScheduler, HeliosTransformer3DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = shared.build_t5_tokenizer(path / "tokenizer", max_length=HELIOS_MAX_LENGTH)
    offsets = shared._SEED_OFFSETS
    shared.save_seeded(path / "transformer", HeliosTransformer3DModel,
                       seed + offsets["transformer"], boost=wan.PROMPT_BOOST,
                       **TINY_HELIOS_TRANSFORMER)
    shared.save_seeded(path / "vae", AutoencoderKLWan, seed + offsets["vae"], **wan.TINY_WAN_VAE)
    HeliosScheduler(**HELIOS_SCHEDULER).save_pretrained(path / "scheduler")
    shared._save(wan.umt5(seed + offsets["text_encoder"], len(tokenizer)), path / "text_encoder")
    write_helios_index(path)
    return path


def write_helios_index(path: Path) -> None:
    """A HeliosPipeline folder's ``model_index.json`` (also written by
    ``scripts/train_motion_model.py``)."""
    shared._write_index(path, "HeliosPipeline", HELIOS_COMPONENTS)


__all__ = ["HELIOS_COMPONENTS", "HELIOS_MAX_LENGTH", "HELIOS_SCHEDULER",
           "TINY_HELIOS_TRANSFORMER", "build_tiny_helios_folder", "write_helios_index"]
