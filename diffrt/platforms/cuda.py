"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

import logging
from typing import Any

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    module_attr = "cuda"

    def register_host_memory(self, tensor: torch.Tensor) -> Any | None:
        """cudaHostRegister through torch's public ``torch.cuda.cudart()``
        binding (ROCm's torch maps it to hipHostRegister)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
            return None
        try:
            cudart = torch.cuda.cudart()
            ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
        except Exception as exc:  # no runtime binding here: the pageable path
            logger.warning("%s: cannot page-lock host memory (%s)", self.name, exc)
            return None
        if int(err) != 0:
            logger.warning("%s: cudaHostRegister of %d bytes failed (error %s)", self.name,
                           nbytes, err)
            return None
        return ptr

    def unregister_host_memory(self, handle: Any) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(handle)
        except Exception as exc:
            logger.warning("%s: cudaHostUnregister failed: %s", self.name, exc)
