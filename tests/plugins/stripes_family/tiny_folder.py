"""Writes a tiny stripes folder (the family's test checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_stripes_folder(path: str | Path, *, seed: int = 0, stripe_height: int = 4,
                         max_size: int = 64) -> Path:
    folder = Path(path)
    (folder / "painter").mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "StripesPipeline", "painter": ["stripes", "Painter"]}
    (folder / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    config = {"stripe_height": stripe_height, "max_size": max_size}
    (folder / "painter" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    weights = torch.rand(3, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    save_file({"colour": weights}, str(folder / "painter" / "painter.safetensors"))
    return folder
