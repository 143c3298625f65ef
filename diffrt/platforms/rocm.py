"""AMD ROCm: a HIP build of torch keeps the torch.cuda API (torch.version.hip is set)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from diffrt.platforms.cuda import CudaPlatform

HIP_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class RocmPlatform(CudaPlatform):
    name = "rocm"
    # RCCL answers to the "nccl" backend name.
    dist_backend = "nccl"
    ray_resource = "GPU"
    device_control_env_var = "HIP_VISIBLE_DEVICES"
    # ROCR_VISIBLE_DEVICES filters in the ROCm runtime; HIP_VISIBLE_DEVICES (or
    # its alias CUDA_VISIBLE_DEVICES) then indexes what is left.
    device_control_env_vars = HIP_VARS + ("ROCR_VISIBLE_DEVICES",)

    def fp8_matmul_supported(self) -> bool:
        """MI300 (gfx94x) or later (gfx95x): torch's ``PLATFORM_SUPPORTS_FP8``
        rule for ROCm (torch/testing/_internal/common_cuda.py)."""
        if not self.is_available():
            return False
        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
        return arch.startswith(("gfx94", "gfx95"))

    @classmethod
    def rank_pinning_env(cls, rank: int, environ: Mapping[str, str],
                         device_count: Callable[[], int]) -> dict[str, str]:
        """With both HIP_VISIBLE_DEVICES and its alias CUDA_VISIBLE_DEVICES set,
        both name the rank's device: a worker left with the caller's full
        CUDA_VISIBLE_DEVICES next to a one-device HIP_VISIBLE_DEVICES would be
        refused by Ray's AMD manager, which asserts they are equal
        (ray/_private/accelerators/amd_gpu.py), and vLLM sets both alike."""
        env = super().rank_pinning_env(rank, environ, device_count)
        if set(env) & set(HIP_VARS) and all(environ.get(v) for v in HIP_VARS):
            value = next(iter(env.values()))
            env = dict.fromkeys(HIP_VARS, value)
        return env
