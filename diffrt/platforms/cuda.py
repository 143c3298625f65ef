"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


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
