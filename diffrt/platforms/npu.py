"""Huawei Ascend NPU: torch_npu registers torch.npu (a PrivateUse1 backend)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from diffrt.platforms import host_lock
from diffrt.platforms.accelerator import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)

#: aclrtHostRegisterV2 flags (torch_npu's npurt binding passes them through)
ACL_HOST_REG_MAPPED = 0x2
ACL_HOST_REG_PINNED = 0x10000000
#: CANN: registering memory that is not already pinned raises up to this kernel
UNLOCKED_REGISTER_FAILS_UP_TO = (5, 10)


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
    # recent torch_npu only (npurt().npuHostRegister wraps aclrtHostRegisterV2);
    # detected at run time. MAPPED is what DeepSpeed measured fast (~23 GB/s vs
    # 8-9 GB/s PINNED-only at 64 MiB); PINNED|MAPPED is unmeasured here.
    host_register_api = ("npurt", "npuHostRegister", "npuHostUnregister")
    host_register_flags = ACL_HOST_REG_MAPPED

    #: torch_npu casts through aclnnCast, which rejects FLOAT8_E4M3FN on Atlas
    #: A2 and later (torch_npu/csrc/aten/ops/op_api/CopyKernelOpApi.cpp,
    #: ``is_aclnn_cast_unsupported_dtype``; torch_npu falls back to a CPU cast
    #: only for host-to-device copies), and no device run has shown a float8
    #: weight cast working on an NPU
    fp8_storage_refusal = ("torch_npu casts through aclnnCast, which rejects float8_e4m3fn on "
                           "Atlas A2 and later (torch_npu's CopyKernelOpApi.cpp), and no NPU "
                           "run has shown it working")

    def register_host_memory(self, tensor: torch.Tensor) -> Any | None:
        """Lock the arena (``mlock``), then register it MAPPED, as DeepSpeed's
        NPU accelerator does. MAPPED needs 4 KiB-aligned addresses: an
        unaligned start is the staged path, an unaligned tail stays unregistered
        (copies into it are synchronous, still correct). Where the lock fails and
        the kernel is one on which CANN documents unlocked registration to fail
        (<= 5.10), the staged path is taken with a one-line reason."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            return None
        ptr = tensor.data_ptr()
        nbytes = (tensor.numel() * tensor.element_size()) // host_lock.PAGE * host_lock.PAGE
        if ptr % host_lock.PAGE or not nbytes:
            logger.warning("npu: output arena at %#x is not 4 KiB-aligned (MAPPED registration "
                           "needs it): staged copies", ptr)
            return None
        if self._host_register_calls() is None:
            return None
        why = host_lock.lock_pages(ptr, nbytes)
        if why is not None:
            if host_lock.kernel_version() <= UNLOCKED_REGISTER_FAILS_UP_TO:
                logger.warning("npu: not registering the output arena: %s, and on Linux <= "
                               "5.10 CANN cannot register unlocked memory: staged copies", why)
                return None
            logger.warning("npu: registering the output arena unlocked: %s", why)
        handle = super().register_host_memory(tensor.reshape(-1).view(torch.uint8)[:nbytes])
        if handle is None:
            if why is None:
                host_lock.unlock_pages(ptr, nbytes)
            return None
        return (handle, ptr, nbytes if why is None else 0)

    def unregister_host_memory(self, handle: Any) -> None:
        inner, ptr, locked = handle
        super().unregister_host_memory(inner)
        if locked:
            host_lock.unlock_pages(ptr, locked)
