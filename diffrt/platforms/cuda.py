"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform
from diffrt.platforms.device_facts import DeviceFacts, device_facts

#: flash-attention 2.7.3 widened ``mha_varlen_fwd``'s check from
#: ``is_sm90 || is_sm8x`` to ``cc_major >= 8`` (csrc/flash_attn/flash_api.cpp,
#: Dao-AILab/flash-attention commit bbb21d65, "Generalize arch checks")
FLASH_ATTN_ANY_SM8_PLUS = (2, 7, 3)


def release(version: str) -> tuple[int, ...]:
    """"2.7.4.post1" -> (2, 7, 4): the leading number of each of the first three parts."""
    parts: list[int] = []
    for part in version.split("+")[0].split(".")[:3]:
        number = re.match(r"\d+", part)
        if number is None:
            break
        parts.append(int(number.group()))
    return tuple(parts)


@functools.cache
def _flash_attn() -> tuple[Callable[..., Any], tuple[int, ...]] | None:
    """flash-attention 2's ``flash_attn_varlen_func`` and the package's
    release, where the package is installed."""
    try:
        import flash_attn  # type: ignore[import-not-found]
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func, release(str(getattr(flash_attn, "__version__", "0")))


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

    def device_facts(self) -> DeviceFacts | None:
        """Compute capability, gfx arch and native bfloat16 of this process's
        device, without creating a context where none exists yet (the engine
        process): ``device_facts.device_facts``."""
        index = self._device_index if self._device_index is not None else 0
        return device_facts(self.device_module(), index)

    def bf16_supported(self) -> bool:
        """Native bfloat16 (``is_bf16_supported(including_emulation=False)``:
        capability 8.0+), asked without a context in the engine process."""
        facts = self.device_facts()
        return facts is not None and facts.bf16_native

    def fp8_matmul_supported(self) -> bool:
        """Compute capability 8.9 (Ada) or later: torch's ``_scaled_mm`` rule
        (``PLATFORM_SUPPORTS_FP8`` in torch/testing/_internal/common_cuda.py)
        and torchao's ``is_sm_at_least_89()`` (torchao/utils.py), which its
        float8 conversion asserts."""
        facts = self.device_facts()
        return facts is not None and facts.capability >= (8, 9)

    def flash_attn_runs_on(self, facts: DeviceFacts, version: tuple[int, ...]) -> bool:
        """Whether flash-attention ``version``'s ``mha_varlen_fwd`` accepts the
        device: compute capability 8.x or exactly 9.0 before 2.7.3
        (``is_sm90 || is_sm8x``), 8.0 or later since (``cc_major >= 8``); a
        T4 (7.5) or V100 (7.0) is refused ("FlashAttention only supports
        Ampere GPUs or newer")."""
        major, _ = facts.capability
        if version >= FLASH_ATTN_ANY_SM8_PLUS:
            return major >= 8
        return major == 8 or facts.capability == (9, 0)

    def varlen_attention(self, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        """flash-attention's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False)`` with the same
        offsets for queries and keys, for the half types it computes in (it
        has no float32 kernel), on a device its kernel accepts
        (``flash_attn_runs_on``); None without the package or elsewhere, and
        rows of several sizes then attend through SDPA with a mask."""
        found = _flash_attn()
        if found is None or dtype not in (torch.float16, torch.bfloat16):
            return None
        varlen, version = found
        facts = self.device_facts()
        if facts is None or not self.flash_attn_runs_on(facts, version):
            return None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                   longest: int) -> torch.Tensor:
            return varlen(q, k, v, starts, starts, longest, longest, causal=False)

        return attend
