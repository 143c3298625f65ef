"""Fake vendor runtime pieces rebuilt from the real APIs' signatures and return
conventions, for the issue-28 tests (tests/platforms/test_vendor_stacks.py).
Each names the vendor file and version it mirrors. They record the flags, the
environment and the device (and thread) of each call.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

#: cudaErrorHostMemoryAlreadyRegistered (CUDA runtime API, driver_types.h)
ALREADY_REGISTERED = 712
#: ACL_ERROR_INVALID_PARAM (CANN acl_base.h); torch_npu returns it for ptr == 0
ACL_ERROR_INVALID_PARAM = 100000
#: ACL_ERROR_RT_PARAM_INVALID-like failure CANN returns for unpinned memory on <= 5.10
ACL_ERROR_RT_UNPINNED = 107000


class CudaRuntime:
    """``torch.cuda.cudart()`` of torch 2.13 (torch/csrc/cuda/shared/cudart.cpp,
    also hipified for ROCm and copied as ``torch.musa.musart()`` by torch_musa):
    ``cudaHostRegister(ptr: int, size: int, flags: int) -> error code`` and
    ``cudaHostUnregister(ptr) -> error code``, wrapped in
    ``C10_CUDA_ERROR_HANDLED``, which returns the code WITHOUT clearing the
    runtime's per-thread last error. ``launch()`` is a kernel launch checked
    by ``C10_CUDA_KERNEL_LAUNCH_CHECK`` (c10/cuda/CUDAException.h): it reads
    (and clears) the calling thread's last error and raises if one was set.
    Registering the same range twice fails with cudaErrorHostMemoryAlreadyRegistered.
    """

    def __init__(self, prefix: str = "cuda", device_module: ModuleType | None = None) -> None:
        self.calls: list[tuple] = []
        self._registered: set[int] = set()
        self._last_error = threading.local()
        self._device_module = device_module
        setattr(self, f"{prefix}HostRegister", self._register)
        setattr(self, f"{prefix}HostUnregister", self._unregister)

    def _device(self) -> int | None:
        mod = self._device_module
        return None if mod is None else mod.current_device()

    def _register(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags, threading.get_ident(), self._device()))
        if ptr in self._registered:
            self._last_error.code = ALREADY_REGISTERED
            return ALREADY_REGISTERED
        self._registered.add(ptr)
        return 0

    def _unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, threading.get_ident(), self._device()))
        self._registered.discard(ptr)
        return 0

    def launch(self) -> None:
        code = getattr(self._last_error, "code", 0)
        self._last_error.code = 0
        if code:
            raise RuntimeError(f"CUDA error: {code} (an earlier call's error, seen at launch)")


def locked_bytes(ptr: int) -> int:
    """The ``Locked:`` size of the mapping holding ``ptr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= ptr < end
            elif inside and head == "Locked:":
                return int(line.split()[1]) * 1024
    return 0


class NpuRuntime:
    """``torch.npu.npurt()`` of torch_npu 2.13 / Ascend/pytorch master
    (torch_npu/csrc/npu/npurt.cpp): ``npuHostRegister(ptr: int, size: int,
    flags: int) -> int`` calling ``aclrtHostRegisterV2`` (0 or an ACL error
    code; ACL_ERROR_INVALID_PARAM for ptr 0), ``npuHostUnregister(ptr) -> int``.
    With ``old_kernel`` it behaves as CANN documents for Linux <= 5.10: memory
    that is not already page-locked is refused; it checks the real lock state
    of the mapping (/proc/self/smaps), and MAPPED needs 4 KiB alignment."""

    def __init__(self, old_kernel: bool = True) -> None:
        self.calls: list[tuple] = []
        self.old_kernel = old_kernel

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        locked = locked_bytes(ptr)
        self.calls.append(("register", ptr, size, flags, locked))
        if ptr == 0 or (flags & 0x2 and (ptr % 4096 or size % 4096)):
            return ACL_ERROR_INVALID_PARAM
        if self.old_kernel and locked < size:
            return ACL_ERROR_RT_UNPINNED
        return 0

    def npuHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, locked_bytes(ptr)))
        return 0


def page_aligned_arena(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A shared anonymous mapping (page-aligned, like the memfd output arena)
    and a uint8 tensor over it. Keep the mmap alive while the tensor is used."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def bf16_check(native: bool) -> object:
    """``is_bf16_supported(including_emulation: bool = True)`` of torch 2.13's
    torch/cuda/__init__.py and torch/xpu/__init__.py: True with emulation on any
    device that can hold a bfloat16 tensor (T4, V100, Arc A), else only where
    the device computes in it natively (capability >= 8.0; XPU:
    has_bfloat16_conversions)."""
    calls: list[bool] = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        calls.append(including_emulation)
        return True if including_emulation else native

    is_bf16_supported.calls = calls  # type: ignore[attr-defined]
    return is_bf16_supported


def ray_module(gpu_ids: list[int]) -> ModuleType:
    """The part of ``ray`` (python/ray/_private/worker.py, Ray 2.5x) a rank
    actor uses to pin itself: ``get_gpu_ids() -> list`` of the GPU ids Ray
    assigned to this worker (empty when it reserved none)."""
    mod = ModuleType("ray")
    mod.get_gpu_ids = lambda: list(gpu_ids)
    return mod


def level_zero_visible(physical: int, env: dict[str, str]) -> list[int]:
    """Physical Intel GPUs a process sees: Level Zero applies ZE_AFFINITY_MASK
    to the physical devices first (Level Zero spec, "Affinity Mask"), then the
    SYCL runtime's ONEAPI_DEVICE_SELECTOR ``level_zero:<i>,<j>`` indexes what
    is left (oneAPI DPC++ EnvironmentVariables.md; Ray's intel_gpu.py sets that
    form for every actor)."""
    devices = list(range(physical))
    mask = env.get("ZE_AFFINITY_MASK")
    if mask:
        devices = [d for d in devices if str(d) in {m.strip() for m in mask.split(",")}]
    selector = env.get("ONEAPI_DEVICE_SELECTOR")
    if selector and selector.startswith("level_zero:"):
        wanted = [int(i) for i in selector.split(":", 1)[1].split(",")]
        devices = [devices[i] for i in wanted if i < len(devices)]
    return devices


def runtime_binding(mod: ModuleType, binding: str, runtime: object) -> None:
    """Install ``runtime`` as ``torch.<vendor>.<binding>()`` on a fake module."""
    setattr(mod, binding, lambda: runtime)


def device_properties(major: int, minor: int, gcn_arch: str = "") -> SimpleNamespace:
    """``torch.cuda.get_device_properties(i)`` of torch 2.13 (torch/cuda/__init__.py,
    ``_CudaDeviceProperties`` bound in torch/csrc/cuda/Module.cpp): ``major``,
    ``minor``, ``name`` and, on a ROCm build, ``gcnArchName`` with its feature
    suffix ("gfx942:sramecc+:xnack-")."""
    return SimpleNamespace(major=major, minor=minor, name=f"Fake sm{major}{minor}",
                           gcnArchName=gcn_arch)


def cuda_device(mod: ModuleType, major: int, minor: int, gcn_arch: str = "",
                bf16_native: bool | None = None, initialized: bool = False) -> ModuleType:
    """Give a fake ``torch.cuda`` one device of capability (major, minor).

    As torch 2.13's torch/cuda/__init__.py does, ``get_device_capability``,
    ``get_device_properties`` and ``is_bf16_supported`` run ``_lazy_init()``
    first: in a process without a context they create one, counted in
    ``mod.contexts_created``; ``is_initialized()`` says whether one exists.
    ``is_bf16_supported(including_emulation=False)`` is True from capability 8.0
    (always on ROCm), as there."""
    state = {"initialized": initialized}
    mod.contexts_created = 0
    native = (major >= 8 or bool(gcn_arch)) if bf16_native is None else bf16_native

    def lazy_init() -> None:
        if not state["initialized"]:
            state["initialized"] = True
            mod.contexts_created += 1

    def get_device_properties(device: object = None) -> SimpleNamespace:
        lazy_init()
        return device_properties(major, minor, gcn_arch)

    def get_device_capability(device: object = None) -> tuple[int, int]:
        lazy_init()
        return (major, minor)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        lazy_init()
        return True if including_emulation else native

    mod.is_initialized = lambda: state["initialized"]
    mod.get_device_properties = get_device_properties
    mod.get_device_capability = get_device_capability
    mod.is_bf16_supported = is_bf16_supported
    return mod


def flash_attn_module(version: str) -> ModuleType:
    """The ``flash_attn`` package of Dao-AILab/flash-attention: ``__version__``
    (flash_attn/__init__.py) and ``flash_attn_varlen_func(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, ...)`` (flash_attn/flash_attn_interface.py,
    v2.8.3). Which devices its kernel accepts is the platform's to know
    (csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd``; the CK build's
    ``allowed_archs`` in setup.py); this records the calls it gets."""
    mod = ModuleType("flash_attn")
    mod.__version__ = version
    mod.calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,  # noqa: ANN001
                               max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False):
        mod.calls.append((max_seqlen_q, max_seqlen_k, causal))
        return q

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


def broken_install(root: Path, package: str, dist: str, version: str, requires: str,
                   error: str, entry_point: bool = False) -> Path:
    """An installed vendor package under ``root`` (on sys.path) whose import
    raises ``ImportError(error)``: a wheel's ``<dist>-<version>.dist-info``
    with its METADATA (``Requires-Dist: <requires>``) and, with
    ``entry_point``, the ``torch.backends`` entry point that Ascend/pytorch's
    and MooreThreads/torch_musa's setup.py register (``<package> =
    <package>:_autoload``), which torch loads inside ``import torch``."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text(f"raise ImportError({error!r})\n")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"  # a wheel's normalised name
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                   f"Requires-Dist: {requires}\n")
    if entry_point:
        (info / "entry_points.txt").write_text(
            f"[torch.backends]\n{package} = {package}:_autoload\n")
    return root


__all__ = ["ACL_ERROR_INVALID_PARAM", "ALREADY_REGISTERED", "CudaRuntime", "NpuRuntime",
           "SimpleNamespace", "bf16_check", "broken_install", "cuda_device", "device_properties",
           "flash_attn_module", "level_zero_visible", "locked_bytes",
           "page_aligned_arena", "ray_module", "runtime_binding"]
