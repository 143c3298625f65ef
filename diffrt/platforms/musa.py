"""Moore Threads MUSA: torch_musa registers torch.musa (a PrivateUse1 backend)."""

from __future__ import annotations

from diffrt.platforms.accelerator import TorchAcceleratorPlatform


class MusaPlatform(TorchAcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    dist_backend = "mccl"
    ray_resource = "MUSA"
    device_control_env_var = "MUSA_VISIBLE_DEVICES"
    module_attr = "musa"
    vendor_package = "torch_musa"
    # torch_musa maps Event(blocking=True) to musaEventBlockingSync like CUDA
    event_options = {"blocking": True}
    event_sync_sleeps = True
    host_register_api = ("musart", "musaHostRegister", "musaHostUnregister")
