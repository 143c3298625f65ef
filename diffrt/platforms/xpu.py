"""Intel GPU: native torch.xpu (torch >= 2.5). intel_extension_for_pytorch is
imported when installed and built for this torch, never required (its
development stopped after 2.8)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

import torch

from diffrt.platforms import vendor_packages
from diffrt.platforms.accelerator import TorchAcceleratorPlatform

logger = logging.getLogger(__name__)

IPEX = "intel_extension_for_pytorch"
#: registers the "ccl" torch.distributed backend on torch < 2.8 (oneCCL's bindings)
ONECCL = "oneccl_bindings_for_pytorch"
#: the SYCL runtime's device filter; Ray's Intel GPU manager pins actors with
#: ``level_zero:<ids>`` (ray/_private/accelerators/intel_gpu.py)
SELECTOR = "ONEAPI_DEVICE_SELECTOR"


def selector_ids(value: str) -> list[str] | None:
    """The device ids of a ``level_zero:<id>,<id>`` selector (Ray's form), or
    None for any other selector (``level_zero:gpu``, several backends...)."""
    backend, _, ids = value.partition(":")
    if backend.strip() != "level_zero" or ";" in ids:
        return None
    parts = [p.strip() for p in ids.split(",") if p.strip()]
    if not parts or not all(p.replace(".", "").isdigit() for p in parts):
        return None
    return parts


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
        built_for = ".".join(str(p) for p in _major_minor(ipex_version))
        vendor_packages.record_failure(IPEX, (
            f"{IPEX} {ipex_version} is installed but not imported: it is built for torch "
            f"{built_for}, this is torch {torch.__version__} (IPEX refuses another major.minor "
            "on import; its development stopped after 2.8: torch.xpu serves Intel GPUs "
            "without it)"))
        return False
    failure = vendor_packages.try_import(IPEX)  # an optional extra never takes the platform down
    return failure is None


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

    @classmethod
    def rank_pinning_env(cls, rank: int, environ: Mapping[str, str],
                         device_count: Callable[[], int]) -> dict[str, str]:
        """Under Ray (``ONEAPI_DEVICE_SELECTOR=level_zero:2,3``) the rank gets
        the selector narrowed to its own id. ZE_AFFINITY_MASK filters in Level
        Zero, below SYCL, and the selector then indexes what is left: a
        ZE_AFFINITY_MASK=1 next to level_zero:2,3 leaves the rank no device.
        Elsewhere ZE_AFFINITY_MASK pins as before."""
        ids = selector_ids(environ.get(SELECTOR, ""))
        if ids:
            return {SELECTOR: f"level_zero:{ids[rank % len(ids)]}"}
        return super().rank_pinning_env(rank, environ, device_count)

    def distributed_backend(self) -> str:
        """"xccl" on torch >= 2.8 (built in). Before, "ccl" exists only once
        oneCCL's bindings are imported; without them several ranks are refused
        in one line instead of failing inside init_process_group."""
        if self.dist_backend != "ccl":
            return self.dist_backend
        try:
            importlib.import_module(ONECCL)
        except ImportError as exc:
            raise RuntimeError(
                f"xpu: several ranks on torch {torch.__version__} need {ONECCL} for the 'ccl' "
                f"backend ({exc}); install oneCCL's bindings for this torch, or use torch >= "
                "2.8, whose 'xccl' is built in") from None
        return "ccl"

    def device_module(self) -> ModuleType:
        if not self._ipex_checked:
            # Once, when first used: older stacks get torch.xpu from IPEX, newer
            # ones gain its optimisations; without IPEX native torch.xpu serves.
            self._ipex_checked = True
            load_ipex()
        return super().device_module()
