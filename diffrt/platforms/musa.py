"""Moore Threads MUSA: torch_musa registers torch.musa (a PrivateUse1 backend)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class MusaPlatform(TorchAcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    dist_backend = "mccl"
    device_control_env_var = "MUSA_VISIBLE_DEVICES"

    def device_module(self) -> ModuleType:
        mod = getattr(torch, "musa", None)
        if mod is None:
            importlib.import_module("torch_musa")
            mod = torch.musa
        return mod
