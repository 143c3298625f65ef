"""AMD ROCm: a HIP build of torch keeps the torch.cuda API (torch.version.hip is set)."""

from __future__ import annotations

from diffrt.platforms.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    # RCCL answers to the "nccl" backend name; HIP honours CUDA_VISIBLE_DEVICES.
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
