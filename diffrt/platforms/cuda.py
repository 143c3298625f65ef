"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    module_attr = "cuda"
