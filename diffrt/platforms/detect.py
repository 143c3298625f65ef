"""Cheap probes, one per built-in platform: ``detect_<name>() -> class path | None``.

They are the values of the ``diffrt.platform_plugins`` entry points, so the
built-ins are peers of out-of-tree plugins. A probe never initialises a device
(no CUDA context, no fork poisoning) and never imports a vendor package that is
not installed (``importlib.util.find_spec`` first). The vendor module of the
chosen platform is imported later, by the platform itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from diffrt.platforms import vendor_packages

logger = logging.getLogger(__name__)

CUDA = "diffrt.platforms.cuda.CudaPlatform"
ROCM = "diffrt.platforms.rocm.RocmPlatform"
NPU = "diffrt.platforms.npu.NpuPlatform"
XPU = "diffrt.platforms.xpu.XpuPlatform"
MUSA = "diffrt.platforms.musa.MusaPlatform"
CPU = "diffrt.platforms.cpu.CpuPlatform"


def _nvml_style_count(name: str) -> int:
    """torch's NVML/AMD-SMI device count (-1 when that library is unusable).

    Unlike ``torch.cuda.device_count()`` this never falls back to
    ``cudaGetDeviceCount``, which initialises the driver and poisons fork.
    """
    counter = getattr(torch.cuda, name, None)
    if counter is None:
        return -1
    try:
        return int(counter())
    except Exception as exc:  # a broken management library means "unknown"
        logger.debug("%s failed: %s", name, exc)
        return -1


#: seconds the subprocess device count may take (it initialises the driver)
SUBPROCESS_PROBE_TIMEOUT_S = 60.0


@functools.lru_cache(maxsize=1)
def subprocess_device_count() -> int:
    """``torch.cuda.device_count()`` in a short-lived child process (the driver
    is initialised there, never in this process, so fork stays safe); -1 when
    the child fails or times out."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=SUBPROCESS_PROBE_TIMEOUT_S, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        logger.warning("the subprocess device count failed: %s", exc)
        return -1


def _count_or_probe(library: str, name: str) -> int:
    """The management library's count; when that library is unusable, a count
    from a subprocess, with a warning naming the library that failed (a GPU
    machine must not be served on CPU in silence)."""
    count = _nvml_style_count(name)
    if count >= 0:
        return count
    count = subprocess_device_count()
    logger.warning("%s is unusable here; a subprocess counted %d device(s)", library,
                   max(count, 0))
    return count


def detect_cuda() -> str | None:
    """NVIDIA GPUs: a CUDA build of torch and NVML counting at least one device
    (NVML unusable: a count from a subprocess; Jetson has no NVML)."""
    if getattr(torch.version, "cuda", None) is None or getattr(torch.version, "hip", None):
        return None
    if os.path.exists("/etc/nv_tegra_release") and _nvml_style_count("_device_count_nvml") < 0:
        return CUDA  # Jetson has no NVML
    return CUDA if _count_or_probe("NVML", "_device_count_nvml") > 0 else None


def detect_rocm() -> str | None:
    """AMD GPUs: a HIP build of torch (build-time fact) and a GPU present."""
    if not getattr(torch.version, "hip", None):
        return None
    if _nvml_style_count("_device_count_amdsmi") < 0 and os.path.exists("/dev/kfd"):
        return ROCM  # amdsmi not installed: the kernel driver node says a GPU is there
    return ROCM if _count_or_probe("amdsmi", "_device_count_amdsmi") > 0 else None


def _vendor_available(package: str, attr: str) -> bool:
    """Import an installed vendor package and ask ``torch.<attr>.is_available()``.
    A package that fails to import is kept with its reason
    (``vendor_packages.import_failures``) for the platform report."""
    if importlib.util.find_spec(package) is None:
        return False
    if vendor_packages.try_import(package) is not None:
        return False
    try:
        return bool(getattr(torch, attr).is_available())
    except Exception as exc:  # e.g. torch_npu without the CANN libraries
        logger.warning("%s is installed but unusable: %s", package, exc)
        return False


def detect_npu() -> str | None:
    """Ascend NPUs: torch_npu installed and ``torch.npu.is_available()``."""
    return NPU if _vendor_available("torch_npu", "npu") else None


def detect_musa() -> str | None:
    """Moore Threads GPUs: torch_musa installed and ``torch.musa.is_available()``."""
    return MUSA if _vendor_available("torch_musa", "musa") else None


def detect_xpu() -> str | None:
    """Intel GPUs: native ``torch.xpu.is_available()`` (Level Zero, fork-safe).

    Stacks older than torch 2.5 get torch.xpu only from IPEX, which is then
    imported if installed and built for this torch.
    """
    xpu = getattr(torch, "xpu", None)
    try:
        if xpu is not None and xpu.is_available():
            return XPU
    except Exception as exc:  # e.g. a Level Zero loader that fails: named in the report
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        vendor_packages.record_failure("torch.xpu", (
            f"torch.xpu.is_available() failed ({type(exc).__name__}: {first}); this is torch "
            f"{torch.__version__}: check the Intel GPU driver and Level Zero loader"))
    if xpu is None:
        from diffrt.platforms.xpu import load_ipex

        if load_ipex() and getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
            return XPU
    return None


def detect_cpu() -> str | None:
    """Always active; resolution uses it only when nothing else is."""
    return CPU


#: Built-in probes in resolution order; cpu is the fallback, not a candidate.
BUILTIN_PROBES: dict[str, Callable[[], str | None]] = {
    "cuda": detect_cuda,
    "rocm": detect_rocm,
    "npu": detect_npu,
    "xpu": detect_xpu,
    "musa": detect_musa,
    "cpu": detect_cpu,
}

def _module_present(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_runtime(name: str) -> str | None:
    """What the installed torch stack lacks for built-in platform ``name``
    (None: nothing). Checked when ``DIFFRT_PLATFORM`` forces a built-in, so a
    forced platform without its runtime fails at once with what to install,
    not later inside a worker. Never initialises a device."""
    version = torch.__version__
    if name == "cuda" and getattr(torch.version, "cuda", None) is None:
        return (f"needs a CUDA build of torch, this is torch {version}: install torch "
                "from https://download.pytorch.org/whl/cu128 (or your CUDA version)")
    if name == "rocm" and not getattr(torch.version, "hip", None):
        return (f"needs a ROCm build of torch, this is torch {version}: install torch "
                "from https://download.pytorch.org/whl/rocm6.4 (or your ROCm version)")
    if name == "npu" and not _module_present("torch_npu"):
        return ("needs torch_npu: pip install 'diffrt[npu]' (torch-npu 2.13.* for torch "
                "2.13.*; torch-npu X.Y needs torch X.Y exactly)")
    if name == "musa" and not _module_present("torch_musa"):
        return "needs torch_musa: install Moore Threads' torch_musa wheel for this torch"
    package = {"npu": "torch_npu", "musa": "torch_musa"}.get(name)
    if package is not None and package not in sys.modules:
        failure = vendor_packages.try_import(package)  # it is imported once chosen anyway
        if failure is not None:
            return failure
    if name == "xpu" and getattr(torch, "xpu", None) is None:
        return (f"needs a torch with XPU support, this is torch {version}: install torch "
                "from https://download.pytorch.org/whl/xpu")
    return None


#: Class path of each built-in, used when ``DIFFRT_PLATFORM`` names one.
BUILTIN_CLASSES: dict[str, str] = {
    "cuda": CUDA, "rocm": ROCM, "npu": NPU, "xpu": XPU, "musa": MUSA, "cpu": CPU,
}
