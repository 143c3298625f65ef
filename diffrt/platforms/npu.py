"""Huawei Ascend NPU: torch_npu registers torch.npu (a PrivateUse1 backend)."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class NpuPlatform(TorchAcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"
    device_control_env_var = "ASCEND_RT_VISIBLE_DEVICES"
    module_attr = "npu"
    vendor_package = "torch_npu"
    # torch_npu parses Event(blocking=True) but does not use it: host waits poll.
    event_sync_sleeps = False
    # recent torch_npu only (aclrtHostRegisterV2; MAPPED = 0x2); detected at run time
    host_register_api = ("npurt", "npuHostRegister", "npuHostUnregister")
    host_register_flags = 0x2
