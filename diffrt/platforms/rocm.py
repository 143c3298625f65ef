"""AMD ROCm: a HIP build of torch keeps the torch.cuda API (torch.version.hip is set)."""

from __future__ import annotations

from diffrt.platforms.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    # RCCL answers to the "nccl" backend name.
    dist_backend = "nccl"
    ray_resource = "GPU"
    device_control_env_var = "HIP_VISIBLE_DEVICES"
    # ROCR_VISIBLE_DEVICES filters in the ROCm runtime; HIP_VISIBLE_DEVICES (or
    # its alias CUDA_VISIBLE_DEVICES) then indexes what is left.
    device_control_env_vars = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                               "ROCR_VISIBLE_DEVICES")
