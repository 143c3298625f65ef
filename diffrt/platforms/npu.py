"""Huawei Ascend NPU: torch_npu registers torch.npu (a PrivateUse1 backend)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class NpuPlatform(TorchAcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"

    def device_module(self) -> ModuleType:
        mod = getattr(torch, "npu", None)
        if mod is None:
            # torch >= 2.5 autoloads torch_npu through the torch.backends entry
            # point; older stacks (or TORCH_DEVICE_BACKEND_AUTOLOAD=0) need the import.
            importlib.import_module("torch_npu")
            mod = torch.npu
        return mod
