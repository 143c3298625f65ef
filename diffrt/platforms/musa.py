"""Moore Threads MUSA: torch_musa registers torch.musa (a PrivateUse1 backend)."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class MusaPlatform(TorchAcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    dist_backend = "mccl"
    # Ray has no MUSA accelerator manager: a custom "MUSA" resource would set no
    # visibility variable, so every actor would see every device. As vllm-musa
    # does, MUSA devices are Ray "GPU"s (``ray start --num-gpus N``) and each
    # rank and replica sets MUSA_VISIBLE_DEVICES from ``ray.get_gpu_ids()``.
    ray_resource = "GPU"
    ray_sets_visibility = False
    device_control_env_var = "MUSA_VISIBLE_DEVICES"
    module_attr = "musa"
    vendor_package = "torch_musa"
    # torch_musa maps Event(blocking=True) to musaEventBlockingSync like CUDA
    event_options = {"blocking": True}
    event_sync_sleeps = True
    host_register_api = ("musart", "musaHostRegister", "musaHostUnregister")
