"""Huawei Ascend NPU: torch_npu registers torch.npu (a PrivateUse1 backend)."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class NpuPlatform(TorchAcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"
    module_attr = "npu"
    vendor_package = "torch_npu"
