"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


@functools.cache
def _flash_attn_varlen() -> Callable[..., Any] | None:
    """flash-attention 2's ``flash_attn_varlen_func``, where the package is installed."""
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_varlen_func


class CudaPlatform(TorchAcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    ray_resource = "GPU"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    module_attr = "cuda"
    # cudaEventBlockingSync: a thread waiting for a copy sleeps instead of spinning
    event_options = {"blocking": True}
    event_sync_sleeps = True
    # torch's public cudart() binding (ROCm's torch maps it to hipHostRegister)
    host_register_api = ("cudart", "cudaHostRegister", "cudaHostUnregister")

    def fp8_matmul_supported(self) -> bool:
        """Compute capability 8.9 (Ada) or later: torch's ``_scaled_mm`` rule
        (``PLATFORM_SUPPORTS_FP8`` in torch/testing/_internal/common_cuda.py)."""
        return self.is_available() and torch.cuda.get_device_capability() >= (8, 9)

    def varlen_attention(self, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        """flash-attention's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False)`` with the same
        offsets for queries and keys, for the half types it computes in (it
        has no float32 kernel); None without the package."""
        varlen = _flash_attn_varlen()
        if varlen is None or dtype not in (torch.float16, torch.bfloat16):
            return None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                   longest: int) -> torch.Tensor:
            return varlen(q, k, v, starts, starts, longest, longest, causal=False)

        return attend
