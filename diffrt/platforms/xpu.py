"""Intel GPU: native torch.xpu (torch >= 2.5). intel_extension_for_pytorch is
imported when installed and built for this torch, never required (its
development stopped after 2.8)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from types import ModuleType

import torch

from diffrt.platforms.accelerator import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)

IPEX = "intel_extension_for_pytorch"


def _major_minor(version: str) -> tuple[int, ...]:
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int(p) for p in parts if p.isdigit())


def load_ipex() -> bool:
    """Import IPEX when installed and built for this torch's major.minor.

    Returns True when it is imported. A mismatched IPEX aborts the interpreter
    on import in some releases, so the versions are compared first from package
    metadata, without importing it.
    """
    if IPEX in sys.modules:
        return True
    if importlib.util.find_spec(IPEX) is None:
        return False
    try:
        ipex_version = importlib.metadata.version("intel-extension-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        ipex_version = ""
    if ipex_version and _major_minor(ipex_version) != _major_minor(torch.__version__):
        logger.warning("not importing %s %s: built for another torch than %s",
                       IPEX, ipex_version, torch.__version__)
        return False
    try:
        importlib.import_module(IPEX)
    except Exception as exc:  # an optional extra must never take the platform down
        logger.warning("importing %s failed: %s", IPEX, exc)
        return False
    return True


class XpuPlatform(TorchAcceleratorPlatform):
    name = "xpu"
    device_type = "xpu"
    # torch 2.8 ships XCCL for XPU; earlier stacks use oneCCL bindings ("ccl").
    dist_backend = "xccl" if _major_minor(torch.__version__) >= (2, 8) else "ccl"
    ray_resource = "GPU"
    device_control_env_var = "ZE_AFFINITY_MASK"

    module_attr = "xpu"
    _ipex_checked = False
    # torch.xpu.Event has no blocking-sync mode: host waits poll query().
    event_sync_sleeps = False
    # On some stacks Event.synchronize() returned before a device-to-host copy
    # had landed (torch-xpu-ops #4349): the copy's stream is synchronised too.
    copy_event_may_precede_copy = True
    # No host-register call in torch.xpu: the output writer stages copies
    # through a pinned buffer (pin_memory works on XPU).
    host_register_api = None

    def device_module(self) -> ModuleType:
        if not self._ipex_checked:
            # Once, when first used: older stacks get torch.xpu from IPEX, newer
            # ones gain its optimisations; without IPEX native torch.xpu serves.
            self._ipex_checked = True
            load_ipex()
        return super().device_module()
