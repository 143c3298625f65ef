"""AMD ROCm: a HIP build of torch keeps the torch.cuda API (torch.version.hip is set)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from diffrt.platforms.cuda import CudaPlatform, release
from diffrt.platforms.device_facts import DeviceFacts

HIP_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
#: torchao's ``is_MI300()`` (torchao/utils.py)
TORCHAO_MI300 = frozenset({"gfx940", "gfx941", "gfx942"})
#: torch's ``_scaled_mm`` on gfx95x needs this ROCm (PLATFORM_SUPPORTS_FP8)
SCALED_MM_GFX95_ROCM = (6, 5)
#: (first flash-attention release, the archs its CK build compiles for),
#: from ``allowed_archs`` in Dao-AILab/flash-attention's setup.py per release
FLASH_ATTN_CK_ARCHS: tuple[tuple[tuple[int, ...], frozenset[str]], ...] = (
    ((0,), frozenset({"gfx90a", "gfx940", "gfx941", "gfx942"})),
    ((2, 8, 0), frozenset({"gfx90a", "gfx942", "gfx950"})),
    ((2, 8, 4), frozenset({"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102",
                           "gfx1150", "gfx1151", "gfx1200", "gfx1201"})),
)


def hip_release() -> tuple[int, ...]:
    """This torch's ROCm release, (major, minor) of ``torch.version.hip``."""
    return release(str(getattr(torch.version, "hip", None) or "0"))[:2]


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
        """Where both libraries the kernel runs through accept the device.
        torchao's float8 conversion asserts ``is_sm_at_least_89() or
        is_MI300() or is_MI350()`` (torchao 0.18 ``quantization/quant_api.py``;
        ``torchao/utils.py``: MI300 is gfx940/941/942, MI350 gfx950), and
        torch's ``_scaled_mm`` supports gfx94x on any ROCm but gfx95x only
        from ROCm 6.5 (``PLATFORM_SUPPORTS_FP8``,
        torch/testing/_internal/common_cuda.py). So: gfx940/941/942, or gfx950
        with ROCm >= 6.5; not Navi (gfx12xx, which torch accepts and torchao
        does not) nor any other gfx95x."""
        facts = self.device_facts()
        if facts is None:
            return False
        if facts.arch in TORCHAO_MI300:
            return True
        return facts.arch == "gfx950" and hip_release() >= SCALED_MM_GFX95_ROCM

    def flash_attn_runs_on(self, facts: DeviceFacts, version: tuple[int, ...]) -> bool:
        """flash-attention's ROCm build (composable_kernel) has no run-time
        arch check: its kernels exist for the archs its setup.py builds,
        ``allowed_archs`` of that release (gfx90a, gfx940/941/942 before 2.8;
        gfx90a, gfx942, gfx950 in 2.8.x; main, 2.8.4, adds RDNA 3/4), and
        another arch fails at the first launch. The Triton backend
        (``FLASH_ATTENTION_TRITON_AMD_ENABLE``) is not told apart: its wider
        support is not claimed."""
        for since, archs in reversed(FLASH_ATTN_CK_ARCHS):
            if version >= since:
                return facts.arch in archs
        return False

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
